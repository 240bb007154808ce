"""The reward router: traj:raw -> score on the task's backend (the router owns retries) -> traj:scored, then ack."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jetroll.services.reward.backends.base import RewardBackend, RewardCall
from jetroll.shared.protocol.bus import Delivery, RedisBus
from jetroll.shared.protocol.claims import FirstClaims, HeldClaims
from jetroll.shared.protocol.events import MetricsEvent, RewardStatus, ScoredEvent, TrajectoryEvent
from jetroll.shared.protocol.ledger import Ledger
from jetroll.shared.protocol.topology import METRICS, SEEN_REWARD, TRAJ_RAW, TRAJ_SCORED
from jetroll.shared.protocol.validate import EventLimits, check_trajectory, expecting
from jetroll.shared.tasks.agent import ENV_REWARD

log = logging.getLogger(__name__)

RAW_STREAM, GROUP = TRAJ_RAW.name, TRAJ_RAW.group
FINAL_STATUSES: tuple[RewardStatus, ...] = ("ok", "timeout", "error", "throttled", "env_fail")
# entries held beyond the backends' concurrency, waiting for a slot: reading them in batches of at least half this
# spares the two round trips (XAUTOCLAIM, XREADGROUP) that reading one entry per finished call costs
READ_AHEAD = 32


class RewardRouter:
    """Consumes trajectories, scores each on its task's backend and publishes one ScoredEvent per traj_id.

    Delivery is at least once: an entry is acked only after its ScoredEvent is written, so a crash
    between the two re-scores it (backends are idempotent per traj_id; the trainer keeps the first event).
    Entries in flight are kept claimed, so a slow call is never reclaimed from under the router.

    Retries (docs/architecture.md, "Who retries"): a throttled call up to `max_throttle_retries` times with
    exponential backoff; a timeout or error `max_retries` times where the backend allows it (never on Lambda).

    Every `forget_every_s` the router forgets the traj_ids of groups the trainer's ledger holds, so its dedupe hash
    stays as small as the work in flight: a later copy of such a trajectory is scored again and the trainer acks it
    untrained.
    """

    def __init__(
        self,
        bus: RedisBus,
        backends: Mapping[str, RewardBackend],
        detokenize: Callable[[np.ndarray], str],
        *,
        limits: EventLimits,
        task_rewards: Mapping[str, str],
        consumer: str,
        default_backend: str = "local",
        task_backends: Mapping[str, str] | None = None,
        max_retries: int = 1,
        max_throttle_retries: int = 5,
        throttle_backoff_s: float = 0.2,
        block_ms: int = 1000,
        metrics_every_s: float = 5.0,
        forget_every_s: float = 5.0,
    ) -> None:
        self.bus = bus
        self.backends = dict(backends)
        self.detokenize = detokenize
        self.is_trajectory = expecting(TrajectoryEvent, lambda event: check_trajectory(event, limits))
        self.consumer = consumer
        self.default_backend = default_backend
        self.task_backends = dict(task_backends or {})
        self.task_rewards = dict(task_rewards)  # task -> the name of its reward
        self.max_retries = max_retries
        self.max_throttle_retries = max_throttle_retries
        self.throttle_backoff_s = throttle_backoff_s
        self.block_ms = block_ms
        self.metrics_every_s = metrics_every_s
        self.forget_every_s = forget_every_s
        self.ledger = Ledger(bus)
        self.seen = FirstClaims(bus, SEEN_REWARD)  # traj_id -> the raw entry that first carried it
        self.max_in_flight = sum(backend.concurrency for backend in self.backends.values()) + READ_AHEAD
        self.counts = {"scored": 0, "ok": 0, "timeout_attempts": 0, "error_attempts": 0, "throttled_attempts": 0,
                       "duplicates": 0, **{f"final_{status}": 0 for status in FINAL_STATUSES}}
        self._in_flight_ids: set[str] = set()
        # finished entries, written and acked together once per loop: (entry id, its ScoredEvent; None for a copy)
        self._outbox: list[tuple[str, ScoredEvent | None]] = []
        self._metrics_at = time.monotonic()
        self._metrics_scored = 0
        self._forgot_at = time.monotonic()
        self.is_running = True

    def stop(self) -> None:
        """End `run` after its current read: a cancel can be lost inside redis-py's blocking read on Python 3.11."""
        self.is_running = False

    async def run(self) -> None:
        """Score trajectories until stopped or cancelled; an exception (e.g. Redis gone) propagates, leaving entries
        unacked."""
        await self.bus.ensure_group(RAW_STREAM, GROUP)
        in_flight: set[asyncio.Task[None]] = set()
        claims = HeldClaims(self.bus, RAW_STREAM, GROUP, self.consumer, self.bus.claim_idle_ms)
        try:
            while self.is_running:
                free = self.max_in_flight - len(in_flight)
                if free >= READ_AHEAD // 2:
                    block_ms = 50 if in_flight else self.block_ms
                    deliveries = await self.bus.consume(
                        RAW_STREAM, GROUP, self.consumer, count=free, block_ms=block_ms, check=self.is_trajectory)
                    in_flight |= await self._start(deliveries)
                if self.max_in_flight - len(in_flight) < READ_AHEAD // 2:
                    await asyncio.wait(in_flight, timeout=claims.every_s, return_when=asyncio.FIRST_COMPLETED)
                done = {task for task in in_flight if task.done()}
                in_flight -= done
                for task in done:
                    task.result()
                await self._flush()
                await claims.keep(self._in_flight_ids)
                await self._maybe_emit_metrics()
                if time.monotonic() - self._forgot_at >= self.forget_every_s:
                    await self._forget_recorded()
                    self._forgot_at = time.monotonic()
            await self._flush()
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _start(self, deliveries: list[Delivery]) -> set[asyncio.Task[None]]:
        """A scoring task per entry that is first to claim its traj_id (one round trip for the batch); copies are
        only acked."""
        # an entry reclaimed while we still work on it is skipped: its task acks it
        fresh = [d for d in deliveries if d.entry_id not in self._in_flight_ids]
        claims: dict[str, str] = {}
        for delivery in fresh:
            assert isinstance(delivery.event, TrajectoryEvent)  # `is_trajectory` dead-lettered anything else
            claims.setdefault(delivery.event.traj_id, delivery.entry_id)
        owned = await self.seen.claim_first(claims)
        tasks = set()
        for delivery in fresh:
            assert isinstance(delivery.event, TrajectoryEvent)
            self._in_flight_ids.add(delivery.entry_id)
            traj_id = delivery.event.traj_id
            if traj_id in owned and claims[traj_id] == delivery.entry_id:
                tasks.add(asyncio.create_task(self.handle(delivery)))
            else:
                self.counts["duplicates"] += 1
                self._outbox.append((delivery.entry_id, None))
        return tasks

    async def handle(self, delivery: Delivery) -> None:
        """Score one raw entry whose traj_id it was first to claim; the loop writes the result, then acks."""
        assert isinstance(delivery.event, TrajectoryEvent)
        scored = await self.score(delivery.event)
        self._outbox.append((delivery.entry_id, scored))  # after the await: the loop swaps the outbox meanwhile

    async def _flush(self) -> None:
        """Write the finished ScoredEvents, then ack their entries (and the copies'): a crash in between re-scores
        them, and the trainer keeps the first event per traj_id."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        await self.bus.publish_many(TRAJ_SCORED.name, [scored for _, scored in outbox if scored is not None])
        entry_ids = [entry_id for entry_id, _ in outbox]
        await self.bus.ack(RAW_STREAM, GROUP, *entry_ids)
        self._in_flight_ids.difference_update(entry_ids)

    async def _forget_recorded(self) -> None:
        """Release the dedupe claims of the trajectories whose groups are in the ledger."""
        traj_ids = await self.seen.claimed()
        group_of = {traj_id: traj_id.rpartition(":")[0] for traj_id in traj_ids}  # traj_id = {group_id}:{sample}
        recorded = await self.ledger.recorded(set(group_of.values()))
        await self.seen.release([traj_id for traj_id, group in group_of.items() if group in recorded])

    async def score(self, traj: TrajectoryEvent) -> ScoredEvent:
        """Score one trajectory with the router's retry rules; what is still not ok after them is final."""
        t0 = time.monotonic()
        backend_name = self.task_backends.get(traj.task, self.default_backend)
        if traj.env_status != "ok":
            status, reward, attempts = "env_fail", None, 0
            details: dict[str, Any] = {"error": f"environment status {traj.env_status!r}"}
        elif self.task_rewards.get(traj.task) == ENV_REWARD:
            # an agent's own reward; none means its episode ran out of budget (length) before the agent reported
            status, reward, attempts = "ok", traj.env_reward or 0.0, 1
            details = {"correct": traj.env_reward == 1.0, "note": "the environment's reward"}
        else:
            status, reward, attempts, details = await self._attempts(traj, backend_name)
        self.counts["scored"] += 1
        self.counts["ok"] += status == "ok"
        self.counts[f"final_{status}"] += 1
        return ScoredEvent(
            job_id=traj.job_id,
            trajectory=traj,
            reward=reward,
            status=status,
            attempts=attempts,
            backend=backend_name,
            latency_s=time.monotonic() - t0,
            details=details,
        )

    async def _attempts(
        self, traj: TrajectoryEvent, backend_name: str
    ) -> tuple[RewardStatus, float | None, int, dict[str, Any]]:
        """(final status, reward, attempts, details) after the retries the backend allows."""
        try:
            reward_name = self.task_rewards[traj.task]
            completion = self.detokenize(traj.completion_ids.numpy())
            backend = self.backends.get(backend_name)
            if backend is None:
                raise ValueError(f"task {traj.task!r} needs reward backend {backend_name!r}, which is not set up")
        except Exception as exc:  # bad input is a final error status, never a lost trajectory
            return "error", None, 0, {"error": f"{type(exc).__name__}: {exc}"}
        attempts = num_throttles = num_failures = 0
        while True:
            attempts += 1
            outcome = await backend.score(RewardCall(traj.traj_id, attempts, reward_name, completion, traj.answer))
            if outcome.status == "ok":
                note = {"note": outcome.detail} if outcome.detail else {}
                return "ok", outcome.reward, attempts, {"correct": outcome.correct, **note}
            self.counts[f"{outcome.status}_attempts"] += 1
            if outcome.status == "throttled" and num_throttles < self.max_throttle_retries:
                await asyncio.sleep(self.throttle_backoff_s * 2**num_throttles * random.uniform(0.5, 1.0))
                num_throttles += 1
            elif outcome.status != "throttled" and backend.can_retry_failures and num_failures < self.max_retries:
                num_failures += 1
            else:
                log.warning("reward %s for %s final after %d attempts on %s: %s", outcome.status, traj.traj_id,
                            attempts, backend_name, outcome.detail)
                return outcome.status, None, attempts, {"error": outcome.detail}

    async def _maybe_emit_metrics(self) -> None:
        now = time.monotonic()
        elapsed = now - self._metrics_at
        if elapsed < self.metrics_every_s or self.counts["scored"] == self._metrics_scored:
            return
        step = self.counts["scored"]
        values = {
            "reward/throughput_per_s": (step - self._metrics_scored) / elapsed,
            "reward/scored": step,
            "reward/timeouts": self.counts["timeout_attempts"],
            "reward/errors": self.counts["error_attempts"],
            "reward/throttles": self.counts["throttled_attempts"],
            "reward/duplicates": self.counts["duplicates"],
            **{f"reward/final_{status}": self.counts[f"final_{status}"] for status in FINAL_STATUSES[1:]},
        }
        await self.bus.publish(METRICS, MetricsEvent(
            job_id=self.bus.job_id, service="reward", values={name: float(value) for name, value in values.items()},
            step=step))
        self._metrics_at, self._metrics_scored = now, step
