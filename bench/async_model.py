"""The reference figures of `jetroll bench async`: the closed-form bound S* and an event model of the same rules.

The event model runs the staleness rules of docs/architecture.md with zero orchestration latency, on the timing engine's
own draws (same traj_ids, so the same lengths as the measured run): admission while admitted <= (v + eta + 1) * B,
samples decoded FIFO on `num_slots` slots, a step on B complete groups oldest first that waits for an in-flight
group that would pass eta_hard, instant weight publication and swap, groups with a failed environment dropped.
The bench picks the rollout fraction f with it and reports its speedup beside the measured one.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from jetroll.shared.config.rollout import TimingEngineConfig
from jetroll.shared.config.staleness import eta_hard_of
from jetroll.shared.engine.timing import draw


def expected_max_s(config: TimingEngineConfig, n: int, num_draws: int = 20_000, seed: int = 0) -> float:
    """E[max of n generation times] (Monte Carlo) for the engine's lognormal lengths."""
    rng = np.random.default_rng(seed)
    sigma2 = math.log1p(config.cv**2)
    lengths = rng.lognormal(math.log(config.mean_tokens) - sigma2 / 2, math.sqrt(sigma2), (num_draws, n))
    return float(lengths.max(axis=1).mean()) * config.token_time_s


def bound(e_max_s: float, mean_s: float, num_trajectories: int, num_slots: int, train_sync_s: float) -> float:
    """S* = (E[max_N L] + T + W) / (N E[L] / R + T + W): sync pays the longest trajectory per step, async the mean."""
    return (e_max_s + train_sync_s) / (num_trajectories * mean_s / num_slots + train_sync_s)


@dataclass(slots=True)
class ModelRun:
    step_times_s: list[float] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)  # one per trained trajectory
    trainer_busy_s: float = 0.0

    def throughput(self, group_traj: int, num_warmup_steps: int) -> float:
        """Trained trajectories per second after the warm-up steps."""
        times = self.step_times_s
        return (len(times) - num_warmup_steps) * group_traj / (times[-1] - times[num_warmup_steps - 1])


class Durations:
    """Memoised (seconds on a slot, env failed) of each traj_id: the f grid reuses the draws."""

    def __init__(self, config: TimingEngineConfig) -> None:
        self.config = config
        self.chunk_s = config.chunk_tokens * config.token_time_s
        self.cache: dict[str, tuple[float, bool]] = {}

    def __call__(self, traj_id: str) -> tuple[float, bool]:
        if traj_id not in self.cache:
            fate = draw(self.config, traj_id)
            # a sample starts on a chunk boundary and ends on the first one after its last token
            self.cache[traj_id] = (math.ceil(fate.duration_s / self.chunk_s - 1e-9) * self.chunk_s, fate.is_env_fail)
        return self.cache[traj_id]


def simulate(durations: Durations, *, num_groups: int, group_size: int, num_slots: int, eta: int, train_s: float,
             num_steps: int) -> ModelRun:
    """One run of the event model; `eta` 0 is sync (every admitted group is required each step)."""
    run = ModelRun()
    now, version, num_admitted, num_dropped = 0.0, 0, 0, 0
    queue: deque[tuple[int, int]] = deque()  # (group index, sample), FIFO
    running: list[tuple[float, int, int, int]] = []  # heap of (finish, group, sample, version at start)
    v_adm: dict[int, int] = {}
    start_version: dict[int, int] = {}  # oldest version a group's samples started at
    num_done: dict[int, int] = {}
    failed: set[int] = set()
    complete: list[int] = []
    train_done_at: float | None = None

    def admit() -> None:
        nonlocal num_admitted
        allowed = min((version + eta + 1) * num_groups, num_steps * num_groups) - (num_admitted - num_dropped)
        for _ in range(max(0, allowed)):
            num_admitted += 1
            v_adm[num_admitted] = version
            queue.extend((num_admitted, i) for i in range(group_size))

    admit()
    while version < num_steps:
        while len(running) < num_slots and queue:
            group, sample = queue.popleft()
            duration_s, _ = durations(f"g{group:07d}:{sample}")
            heapq.heappush(running, (now + duration_s, group, sample, version))
            start_version[group] = min(start_version.get(group, version), version)
        if train_done_at is None:
            # v_adm holds the groups in flight (admitted, neither trained nor dropped), in admission order
            required = [g for g in v_adm if v_adm[g] <= version - eta_hard_of(eta)][:num_groups]
            if len(complete) >= num_groups and all(g in complete for g in required):
                batch = sorted(complete, key=lambda g: (g not in required, v_adm[g], g))[:num_groups]
                for group in batch:
                    complete.remove(group)
                    del v_adm[group]
                    run.lags += [version - start_version[group]] * group_size
                train_done_at = now + train_s
                run.trainer_busy_s += train_s
        next_finish = running[0][0] if running else math.inf
        if train_done_at is not None and train_done_at <= next_finish:
            now, train_done_at = train_done_at, None
            version += 1
            run.step_times_s.append(now)
            admit()
            continue
        now, group, sample, _ = heapq.heappop(running)
        num_done[group] = num_done.get(group, 0) + 1
        if durations(f"g{group:07d}:{sample}")[1]:
            failed.add(group)
        if num_done[group] == group_size:
            if group in failed:  # dropped whole by the trainer; admission replaces it
                del v_adm[group]
                num_dropped += 1
                admit()
            else:
                complete.append(group)
    return run
