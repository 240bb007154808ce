"""`jetroll bench async`: trajectory-level asynchrony against the synchronous baseline, on the same resources.

Every setting is a whole job through the real launcher, Redis Streams, controller (admission), rollout worker, reward
router and trainer loop; only the two compute-bound parts are timing models: the rollout engine (`rollout.engine:
timing`) and the trainer step (`trainer.engine: timing`). The parameters are pinned (issue 4):

- N = R = 256: 32 groups x 8 samples per step, 256 decode slots when all resources roll out;
- lognormal lengths, mean 512 tokens at 200 us per token (E[L] = 0.1 s), advanced in chunks of 16 tokens;
- T + W = 3/7 E[max_N L], so rollout is 70% of an ideal sync step;
- sync is colocated: R slots roll out, then the trainer takes T + W; its ideal is one step per E[max_N L] + T + W;
- async gives f R slots to rollout and the trainer takes (T + W) / (1 - f); f is picked from a grid by the event
  model (bench/async_model.py), which also gives a zero-overhead reference speedup.

Throughput counts trained trajectories per second over the steps after a warm-up. Lengths are a pure function of the
traj_id, so every setting sees the same draws; the sync row also reports its efficiency against the draws it got (the
mean max of its steps), which separates orchestration cost from sampling noise.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from jetroll.bench.async_model import Durations, bound, expected_max_s, simulate
from jetroll.bench.rows import read_jsonl
from jetroll.services.launch.local import Launcher
from jetroll.services.launch.redis_server import RedisServer
from jetroll.shared.config.job import validate_config
from jetroll.shared.config.model import ModelConfig, WarmStartConfig
from jetroll.shared.config.rollout import TimingEngineConfig
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.ledger import Ledger, Outcome
from jetroll.shared.tasks.registry import TaskSet
from jetroll.shared.warm_start import ensure_base_model

log = logging.getLogger("jetroll.bench.async")

F_GRID = (0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5)
TRAIN_FRACTION_OF_MAX = 3 / 7  # T + W = 3/7 E[max_N L]
STRESS_FAIL_FRAC, STRESS_SLOWDOWN = 0.05, 10.0
F_PICK_STEPS = 40  # the event model picks f over a longer horizon than a measured run
# only the tokenizer and the published weights matter: an untrained 1-layer model
BENCH_MODEL = ModelConfig(num_layers=1, intermediate_size=256,
                          warm_start=WarmStartConfig(max_steps=0, target_band=None))


@dataclass(frozen=True, slots=True)
class Scale:
    """The pinned parameters (FULL); QUICK shrinks them for a smoke test."""

    num_groups: int = 32
    group_size: int = 8
    num_slots: int = 256
    mean_tokens: int = 512
    token_time_s: float = 2e-4
    num_steps: int = 10  # at least; more where an ideal sync step is short, to fill min_window_s
    num_warmup_steps: int = 2
    min_window_s: float = 10.0  # measured steps x an ideal sync step: the sync max-of-N draws average out
    num_stress_steps: int = 6  # a sync step under stress takes several rounds of 10x-slow failures
    cvs: tuple[float, ...] = (0.5, 1.0, 2.0)
    etas: tuple[int, ...] = (0, 1, 2, 4)
    has_stress: bool = True

    @property
    def num_trajectories(self) -> int:
        return self.num_groups * self.group_size


FULL = Scale()
QUICK = Scale(num_groups=8, num_slots=64, num_steps=5, num_warmup_steps=2, min_window_s=0.0, cvs=(1.0,), etas=(2,),
              has_stress=False)


@dataclass(frozen=True, slots=True)
class Setting:
    cv: float
    mode: Literal["sync", "async"]
    eta: int
    rollout_frac: float  # f: the share of the R slots that rolls out (1 for sync)
    train_s: float  # the trainer's modelled step, weight publication included
    is_stress: bool = False

    @property
    def name(self) -> str:
        mode = "sync" if self.mode == "sync" else f"async-eta{self.eta}"
        return f"cv{self.cv:g}-{mode}{'-stress' if self.is_stress else ''}"


def timing_config(scale: Scale, cv: float, is_stress: bool, seed: int) -> TimingEngineConfig:
    return TimingEngineConfig(mean_tokens=scale.mean_tokens, cv=cv, token_time_s=scale.token_time_s, seed=seed,
                              fail_frac=STRESS_FAIL_FRAC if is_stress else 0.0, fail_slowdown=STRESS_SLOWDOWN)


def job_tree(scale: Scale, setting: Setting, timing: TimingEngineConfig, model_path: str, run_dir: Path) -> dict:
    model = {**BENCH_MODEL.model_dump(mode="json"), "path": model_path}
    return {
        "job_id": f"bench-{setting.name}-{os.getpid()}",
        "model": model,
        "rollout": {"engine": "timing", "timing": timing.model_dump(), "compile": False,
                    "max_batch": max(scale.group_size, round(setting.rollout_frac * scale.num_slots))},
        # 4 calls in flight keep the reward router off the critical path at ~600 trajectories/s
        "reward": {"num_workers": 4},
        "trainer": {"engine": "timing", "timing_step_s": setting.train_s, "max_steps": scale.num_steps,
                    "groups_per_step": scale.num_groups, "group_size": scale.group_size,
                    "checkpoint_every": scale.num_steps},
        "staleness": {"mode": setting.mode, "max_staleness": setting.eta},
        "store": {"root": str(run_dir / "store"), "keep_last": 2},
        "eval": {"num_problems": 1},
        # measure() reads every trained group's outcome: room for them and as many dropped ones
        "redis": {"ledger_keep_groups": 2 * scale.num_steps * scale.num_groups},
    }


def launch_job(tree: dict, run_dir: Path, redis_url: str) -> None:
    launcher = Launcher(validate_config(tree), run_dir, redis_url, is_console=False)
    try:
        code = launcher.supervise()
    finally:
        launcher.stop()
    if code != 0:
        raise RuntimeError(f"bench job {tree['job_id']} failed; see {run_dir / 'logs'}")


def read_ledger(redis_url: str, job_id: str) -> dict[str, Outcome]:
    """The outcomes the job's ledger still keeps (every group, with a large enough `redis.ledger_keep_groups`)."""

    async def read() -> dict[str, Outcome]:
        bus = RedisBus(redis_url, job_id)
        try:
            return await Ledger(bus).outcomes()
        finally:
            await bus.close()

    return asyncio.run(read())


def measure(scale: Scale, setting: Setting, timing: TimingEngineConfig, durations: Durations, model_path: str,
            root: Path, redis_url: str) -> dict[str, Any]:
    """Run one setting as a job and summarise its steps after the warm-up."""
    run_dir = root / setting.name
    run_dir.mkdir(parents=True)
    tree = job_tree(scale, setting, timing, model_path, run_dir)
    started = time.perf_counter()
    launch_job(tree, run_dir, redis_url)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    first, window = rows[scale.num_warmup_steps - 1], rows[scale.num_warmup_steps:]
    window_s = window[-1]["time_s"] - first["time_s"]
    ledger = read_ledger(redis_url, tree["job_id"])
    trained = {g: o for g, o in ledger.items() if o.status == "trained" and o.step > scale.num_warmup_steps}
    num_trajectories = sum(o.num_samples for o in trained.values())
    num_trained = sum(o.status == "trained" for o in ledger.values())
    assert num_trained == scale.num_steps * scale.num_groups, f"the ledger kept {num_trained} trained groups"
    hist: dict[int, int] = {}
    for row in window:
        for key, count in row.items():
            if key.startswith("lag_hist/"):
                hist[int(key.split("/")[1])] = hist.get(int(key.split("/")[1]), 0) + int(count)
    lags = [lag for lag, count in sorted(hist.items()) for _ in range(count)]
    slot_s = window[-1]["rollout_slot_s"] - first["rollout_slot_s"]
    busy_slot_s = window[-1]["rollout_busy_slot_s"] - first["rollout_busy_slot_s"]
    model = simulate(durations, num_groups=scale.num_groups, group_size=scale.group_size,
                     num_slots=tree["rollout"]["max_batch"], eta=setting.eta, train_s=setting.train_s,
                     num_steps=scale.num_steps)
    row: dict[str, Any] = {
        "name": setting.name, "cv": setting.cv, "mode": setting.mode, "eta": setting.eta,
        "is_stress": setting.is_stress, "rollout_frac": setting.rollout_frac,
        "num_rollout_slots": tree["rollout"]["max_batch"], "trainer_step_s": setting.train_s,
        "trajectories_per_s": num_trajectories / window_s,
        "model_trajectories_per_s": model.throughput(scale.num_trajectories, scale.num_warmup_steps),
        "lag": {"mean": statistics.fmean(lags), "p50": statistics.median(lags), "max": max(lags),
                "hist": {str(k): v for k, v in sorted(hist.items())}},
        "rollout_idle_frac": 1.0 - busy_slot_s / slot_s if slot_s > 0 else None,
        "trainer_idle_frac": sum(r["trainer_wait_s"] for r in window) / window_s,
        "stale_wait_s": sum(r["stale_wait_s"] for r in window),
        "stale_masked_tokens": sum(r["stale_masked_tokens"] for r in window),
        "groups_dropped": sum(o.status != "trained" for o in ledger.values()),
        "measured_steps": len(window),
        "window_s": window_s,
        "wall_s": time.perf_counter() - started,
    }
    if setting.mode == "sync" and not setting.is_stress:
        # the ideal of the draws this run got: each step waits for its longest trajectory, then trains
        steps: dict[int, float] = {}
        for group, outcome in trained.items():
            longest = max(durations(f"{group}:{sample}")[0] for sample in range(outcome.num_samples))
            steps[outcome.step] = max(steps.get(outcome.step, 0.0), longest)
        row["realized_ideal_trajectories_per_s"] = num_trajectories / sum(m + setting.train_s for m in steps.values())
    log.info("%s: %.0f trajectories/s (event model %.0f), lag mean %.2f max %d, %.0f s", setting.name,
             row["trajectories_per_s"], row["model_trajectories_per_s"], row["lag"]["mean"], row["lag"]["max"],
             row["wall_s"])
    return row


def pick_rollout_frac(scale: Scale, durations: Durations, eta: int, train_sync_s: float) -> float:
    """The f of the grid with the best event-model throughput."""
    def throughput(f: float) -> float:
        slots = max(scale.group_size, round(f * scale.num_slots))
        run = simulate(durations, num_groups=scale.num_groups, group_size=scale.group_size, num_slots=slots, eta=eta,
                       train_s=train_sync_s / (1 - f), num_steps=max(F_PICK_STEPS, scale.num_steps))
        return run.throughput(scale.num_trajectories, scale.num_warmup_steps)

    return max(F_GRID, key=throughput)


def run_cv(scale: Scale, cv: float, is_stress: bool, etas: tuple[int, ...], seed: int, model_path: str, root: Path,
           redis_url: str) -> list[dict[str, Any]]:
    """Sync, then async at each eta, on one length distribution; speedups against this sync."""
    timing = timing_config(scale, cv, is_stress, seed)
    durations = Durations(timing)
    e_max_s = expected_max_s(timing, scale.num_trajectories)
    mean_s = scale.mean_tokens * scale.token_time_s
    train_sync_s = TRAIN_FRACTION_OF_MAX * e_max_s
    num_window_steps = math.ceil(scale.min_window_s / (e_max_s + train_sync_s))
    num_steps = scale.num_stress_steps if is_stress else max(scale.num_steps, scale.num_warmup_steps + num_window_steps)
    scale = replace(scale, num_steps=num_steps)
    s_star = bound(e_max_s, mean_s, scale.num_trajectories, scale.num_slots, train_sync_s)
    sync = measure(scale, Setting(cv, "sync", 0, 1.0, train_sync_s, is_stress), timing, durations, model_path, root,
                   redis_url)
    rows = [sync]
    for eta in etas:
        f = pick_rollout_frac(scale, durations, eta, train_sync_s)
        rows.append(measure(scale, Setting(cv, "async", eta, f, train_sync_s / (1 - f), is_stress), timing, durations,
                            model_path, root, redis_url))
    ideal_sync = scale.num_trajectories / (e_max_s + train_sync_s)
    for row in rows:
        row |= {"bound": s_star, "e_max_s": e_max_s, "mean_s": mean_s,
                "speedup": row["trajectories_per_s"] / sync["trajectories_per_s"],
                "model_speedup": row["model_trajectories_per_s"] / sync["model_trajectories_per_s"]}
    if not is_stress:
        sync["ideal_trajectories_per_s"] = ideal_sync
        sync["efficiency"] = sync["trajectories_per_s"] / ideal_sync
        sync["efficiency_realized"] = sync["trajectories_per_s"] / sync["realized_ideal_trajectories_per_s"]
    return rows


def run_async_bench(quick: bool = False, seed: int = 0, run_dir: Path | None = None) -> dict[str, Any]:
    scale = QUICK if quick else FULL
    started = time.perf_counter()
    model_path = str(ensure_base_model(BENCH_MODEL, TaskSet(), progress=False))
    rows: list[dict[str, Any]] = []
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="jetroll-bench-async-") as tmp:
        root = run_dir or Path(tmp)
        for cv in scale.cvs:
            rows += run_cv(scale, cv, False, scale.etas, seed, model_path, root, server.url)
        if scale.has_stress:
            rows += run_cv(scale, 1.0, True, (2,), seed, model_path, root, server.url)
    return {"config": _config(scale, seed), "rows": rows, "summary": _summary(rows),
            "wall_s": time.perf_counter() - started}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def find(cv: float, mode: str, eta: int, is_stress: bool = False) -> dict[str, Any] | None:
        return next((r for r in rows if (r["cv"], r["mode"], r["eta"], r["is_stress"]) == (cv, mode, eta, is_stress)),
                    None)

    main, sync = find(1.0, "async", 2), find(1.0, "sync", 0)
    assert main is not None and sync is not None, "the bench always runs cv = 1, eta = 2"
    summary: dict[str, Any] = {
        "speedup_cv1_eta2": main["speedup"],
        "speedup_vs_ideal_sync_cv1_eta2": main["trajectories_per_s"] / sync["ideal_trajectories_per_s"],
        "bound_cv1_eta2": main["bound"],
        "max_lag_cv1_eta2": main["lag"]["max"],
        "fraction_of_bound_cv1_eta2": main["speedup"] / main["bound"],
        "model_speedup_cv1_eta2": main["model_speedup"],
        "rollout_frac_cv1_eta2": main["rollout_frac"],
        "is_target_met": main["speedup"] >= 2.0 and main["speedup"] >= 0.8 * main["bound"],
        "sync_efficiency": {f"cv{r['cv']:g}": r["efficiency"] for r in rows if "efficiency" in r},
        "sync_efficiency_realized": {f"cv{r['cv']:g}": r["efficiency_realized"] for r in rows if "efficiency" in r},
    }
    if (stress := find(1.0, "async", 2, is_stress=True)) is not None:
        summary["speedup_stress_cv1_eta2"] = stress["speedup"]
        summary["groups_dropped_stress"] = {r["mode"]: r["groups_dropped"] for r in rows if r["is_stress"]}
    return summary


def _config(scale: Scale, seed: int) -> dict[str, Any]:
    return {
        "scale": {k: getattr(scale, k) for k in Scale.__slots__},
        "f_grid": F_GRID,
        "train_fraction_of_max": TRAIN_FRACTION_OF_MAX,
        "stress": {"fail_frac": STRESS_FAIL_FRAC, "fail_slowdown": STRESS_SLOWDOWN, "cv": 1.0, "eta": 2},
        "seed": seed,
        "statistic": f"trained trajectories / s after {scale.num_warmup_steps} warm-up steps, over at least "
                     f"{scale.num_steps - scale.num_warmup_steps} steps and {scale.min_window_s:g} s of ideal sync "
                     f"steps ({scale.num_stress_steps - scale.num_warmup_steps} steps under stress)",
        "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    scale = result["config"]["scale"]
    table = Table(title=f"async vs sync, N = {scale['num_groups']} x {scale['group_size']}, R = {scale['num_slots']} "
                        f"slots, E[L] = {scale['mean_tokens'] * scale['token_time_s']:.3f} s "
                        f"({result['config']['cpu']})")
    for column in ("cv", "setting", "f", "traj/s", "speedup", "event model", "S*", "lag mean/p50/max",
                   "rollout idle", "trainer idle", "masked tok"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        setting = ("sync" if row["mode"] == "sync" else f"async eta={row['eta']}") + (" stress" if row["is_stress"]
                                                                                     else "")
        if "efficiency" in row:
            setting += f" ({row['efficiency']:.2f} of ideal)"
        lag = row["lag"]
        idle = row["rollout_idle_frac"]
        table.add_row(f"{row['cv']:g}", setting, f"{row['rollout_frac']:.2f}", f"{row['trajectories_per_s']:.0f}",
                      f"{row['speedup']:.2f}x", f"{row['model_speedup']:.2f}x", f"{row['bound']:.2f}",
                      f"{lag['mean']:.2f} / {lag['p50']:g} / {lag['max']}", f"{idle:.2f}" if idle is not None else "-",
                      f"{row['trainer_idle_frac']:.2f}", f"{row['stale_masked_tokens']:.0f}")
    console = Console(width=max(Console().width, 150))
    console.print(table)
    summary = result["summary"]
    console.print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
