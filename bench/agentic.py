"""`jetroll bench agentic`: the multi-environment job (configs/agentic.yaml) under jetroll's trajectory-level pipeline
and under a barrier baseline, each with its flaky environment on and off.

- pipeline: the job as it ships: async, each task on its own rollout pool (its own worker and environments), the
  flaky task with its own staleness bound (docs/architecture.md, "Many tasks in one job");
- barrier: each step waits for all of its episodes (`staleness.mode: sync`, so no task keeps a bound of its own)
  and every environment runs inside one rollout worker's loop (one pool): the loop a user writes without
  disaggregation;
- flaky off: the same job with every `tasks[].env_faults` removed.

Every cell is `jetroll run` in a subprocess from one base, built first and shared, so all start from the same weights
on the same cores. A finished cell leaves row.json and is not run again (resumable). A cell reports trained
trajectories/s over the steps after the first `WARMUP_STEPS` (per task too), the trainer's idle fraction, each pool's
environment set-up share and failures, each task's held-out success by version, and when the mean success over the
tasks first reached the target.

- trl: TRL's GRPOTrainer on the same job (bench/trl_agentic.py): the same base, problems, environments,
  faults, turn protocol and reward, through its `rollout_func`; a barrier loop in one process, which generates every
  turn of a step's episodes in `model.generate` batches. It runs `trl_steps` steps (default: the job's); its
  trajectories/s count every episode it trains on (a failed one too, at reward 0: TRL cannot drop a group), its
  trainer idle fraction is the share of a step spent in the rollout, and its held-out success is jetroll's evaluation
  of its weight snapshots, off its clock.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from jetroll.bench.peers import require_trl
from jetroll.bench.processes import run_job
from jetroll.bench.resume import claim_run_dir
from jetroll.bench.rows import read_jsonl
from jetroll.bench.versions import jetroll_commit, library_versions
from jetroll.functions.scoring import job_tasks
from jetroll.shared.config.job import JobConfig, load_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.warm_start import ensure_base_model

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "agentic.yaml"
DEFAULT_RUN_DIR = Path("~/.cache/jetroll/bench/agentic")
ARMS = ("pipeline", "barrier", "trl")
WARMUP_STEPS = 5  # start-up and the first versions' compiles are not the pipeline's rate
TRL_THREADS = os.cpu_count() or 1  # TRL is one process: every core is its


def arm_overrides(config: JobConfig, arm: str, is_flaky: bool) -> list[str]:
    """The `--set`s that make the job an arm: the barrier's sync mode and single pool, the faults removed."""
    overrides = []
    if arm == "barrier":
        overrides += ["staleness.mode=sync", "rollout.pools=[{name: default}]"]
        overrides += [f"tasks.{i}.max_staleness=null" for i, task in enumerate(config.tasks)
                      if task.max_staleness is not None]
    if not is_flaky:
        overrides += [f"tasks.{i}.env_faults=null" for i, task in enumerate(config.tasks)
                      if getattr(task, "env_faults", None) is not None]
    return overrides


def run_agentic_bench(seeds: int = 1, run_dir: Path | None = None, overrides: list[str] = (),
                      max_steps: int | None = None, target: float | None = None,
                      trl_steps: int | None = None) -> dict[str, Any]:
    run_dir = Path(run_dir or DEFAULT_RUN_DIR).expanduser().resolve()
    extra = [*overrides, f"model.cache_dir={run_dir / 'cache'}",
             *([f"trainer.max_steps={max_steps}"] if max_steps else [])]
    config = load_config(CONFIG, extra)  # a bad override fails here, before any cell runs
    require_trl("agentic")
    if not any(getattr(task, "env_faults", None) for task in config.tasks):
        raise ConfigError("bench agentic: no task of the job has env_faults, so flaky on and off are the same job")
    claim_run_dir(run_dir, {"config": CONFIG.read_text(), "overrides": extra}, "agentic")
    print("bench agentic: the base ...", file=sys.stderr, flush=True)
    base = ensure_base_model(config.model, job_tasks(config))
    warm = json.loads((base / "warmstart.json").read_text())
    rows = []
    for seed in range(seeds):
        for is_flaky in (True, False):
            for arm in ARMS:
                name = f"{arm}-{'flaky' if is_flaky else 'steady'}-s{seed}"
                out = run_dir / name
                if not (out / "row.json").exists():  # a finished cell is not run again
                    cell = [*extra, f"seed={seed}", *arm_overrides(config, arm, is_flaky)]
                    if arm == "trl":
                        run_trl_cell(name, out, base, cell, seed, trl_steps or config.trainer.max_steps, config)
                    else:
                        run_cell(name, out, cell)
                rows.append(json.loads((out / "row.json").read_text()) | {"arm": arm, "flaky": is_flaky,
                                                                           "seed": seed})
    result = {"config": {"config": str(CONFIG), "overrides": extra, "seeds": seeds, "run_dir": str(run_dir),
                         "warmup_steps": WARMUP_STEPS, "trl_steps": trl_steps or config.trainer.max_steps,
                         "trl_threads": TRL_THREADS},
              "base": {"dir": str(base), "steps": warm["steps"], "probe": warm["probe_history"][-1][1]
                       if warm["probe_history"] else None},
              "versions": library_versions(), "rows": rows, "summary": summary(rows, target)}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def run_cell(name: str, out: Path, overrides: list[str]) -> None:
    """One cell from an empty run dir, its whole job timed; the row is written only when it finished."""
    run = out / "run"
    shutil.rmtree(run, ignore_errors=True)  # an interrupted cell starts over: only uninterrupted runs count
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "jetroll.services.cli", "run", str(CONFIG), "--run-dir", str(run),
               *(arg for item in overrides for arg in ("--set", item))]
    print(f"bench agentic: {name} ...", file=sys.stderr, flush=True)
    commit = jetroll_commit()
    code, wall_s = run_job(command, os.environ.copy(), out / "job.log")
    if code != 0:
        raise RuntimeError(f"bench agentic cell {name} failed (exit {code}); see {out / 'job.log'}")
    row = read_cell(run) | {"wall_s": round(wall_s, 1), "commit": commit, "overrides": overrides}
    (out / "row.json").write_text(json.dumps(row, indent=2))
    print(f"bench agentic: {name}: {row['trajectories_per_s']:.1f} trajectories/s, trainer idle "
          f"{row['trainer_idle_frac']:.0%}, {wall_s / 60:.1f} min", file=sys.stderr, flush=True)


def run_trl_cell(name: str, out: Path, base: Path, overrides: list[str], seed: int, steps: int,
                 config: JobConfig) -> None:
    """TRL's arm from an empty directory, its steps timed, then its snapshots evaluated; the row only when done."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    every = config.eval.every_steps or steps
    spec = {"config": str(CONFIG), "overrides": overrides, "base_dir": str(base), "out_dir": str(out), "seed": seed,
            "steps": steps, "threads": TRL_THREADS, "snapshot_every": every}
    (out / "spec.json").write_text(json.dumps(spec))
    print(f"bench agentic: {name} ...", file=sys.stderr, flush=True)
    commit = jetroll_commit()
    command = [sys.executable, "-m", "jetroll.bench.trl_agentic", str(out / "spec.json")]
    code, wall_s = run_job(command, os.environ.copy(), out / "job.log")
    if code != 0:
        raise RuntimeError(f"bench agentic cell {name} failed (exit {code}); see {out / 'job.log'}")
    row = read_trl_cell(out, load_config(CONFIG, overrides)) | {"wall_s": round(wall_s, 1), "commit": commit,
                                                                "overrides": overrides}
    (out / "row.json").write_text(json.dumps(row, indent=2))
    print(f"bench agentic: {name}: {row['trajectories_per_s']:.1f} trajectories/s, trainer idle "
          f"{row['trainer_idle_frac']:.0%}, {wall_s / 60:.1f} min", file=sys.stderr, flush=True)


def read_trl_cell(out: Path, config: JobConfig) -> dict[str, Any]:
    """The TRL arm's row, in the fields of a jetroll cell's (`read_cell`)."""
    from jetroll.shared.evaluate import score_model_dir

    clock = {row["step"]: row["wall_s"] for row in read_jsonl(out / "steps.jsonl")}
    rollouts = read_jsonl(out / "rollouts.jsonl")  # one per batch, in order: batch i ends at step i
    steps = max(clock)
    if steps <= WARMUP_STEPS:
        raise RuntimeError(f"{out}: {steps} steps; the bench measures the steps after the first {WARMUP_STEPS}")
    window_s = clock[steps] - clock[WARMUP_STEPS]
    measured = rollouts[WARMUP_STEPS:steps]
    tasks = [task.name for task in config.tasks]
    by_task = {t: sum(r["by_task"].get(t, 0) for r in measured) / window_s for t in tasks}
    failed_calls = Counter[str]()
    episodes, setup_share_sum = Counter[str](), Counter[str]()
    for r in rollouts:
        failed_calls.update(r["failed_calls"])
        episodes.update(r["episodes"])
        for how, share in r["setup_share"].items():
            setup_share_sum[how] += share * r["episodes"][how]
    pool = {f"env_episodes/{how}": float(n) for how, n in episodes.items()}
    pool |= {f"env_failed_calls/{status}": float(n) for status, n in failed_calls.items()}
    pool |= {f"env_setup_share/{how}": setup_share_sum[how] / n for how, n in episodes.items()}
    task_set = job_tasks(config)
    problems = {t: task_set[t].heldout(config.eval.num_problems) for t in tasks}
    evals = []
    for directory in sorted((out / "snapshots").iterdir(), key=lambda d: int(d.name.split("-")[1])):
        step = int(directory.name.split("-")[1])
        evals.append({"version": step, "time_s": clock[step] - clock[0],
                      **score_model_dir(directory, config, task_set, problems)})
    first, last = evals[0], evals[-1]
    return {
        "steps": steps,
        "trajectories_per_s": sum(by_task.values()),
        "trajectories_per_s_by_task": by_task,
        "step_s": window_s / (steps - WARMUP_STEPS),
        "trainer_idle_frac": statistics.fmean(
            r["rollout_s"] / (clock[i + 1] - clock[i]) for i, r in enumerate(rollouts[:steps]) if i >= WARMUP_STEPS),
        "stale_wait_frac": 0.0,
        "pools": {"trl": pool},
        "evals": evals,
        "accuracy_before_per_task": {t: first[t] for t in tasks},
        "accuracy_after_per_task": {t: last[t] for t in tasks},
        "groups_dropped": 0,
        "dropped_by_status": {},
    }


def read_cell(run: Path) -> dict[str, Any]:
    config = json.loads((run / "config.json").read_text())
    rows = read_jsonl(run / "metrics.jsonl")
    evals = read_jsonl(run / "eval.jsonl")
    summary_json = json.loads((run / "summary.json").read_text())
    if len(rows) <= WARMUP_STEPS:
        raise RuntimeError(f"{run}: {len(rows)} steps; the bench measures the steps after the first {WARMUP_STEPS}")
    measured = rows[WARMUP_STEPS:]
    window_s = measured[-1]["time_s"] - rows[WARMUP_STEPS - 1]["time_s"]
    per_group = config["trainer"]["group_size"] / window_s
    tasks = [task["name"] for task in config["tasks"]]
    last = rows[-1]
    pools = sorted({key.split("/")[1] for key in last if key.startswith("pool/")})
    return {
        "steps": len(rows),
        "trajectories_per_s": sum(r.get(f"groups/{t}", 0) for r in measured for t in tasks) * per_group,
        "trajectories_per_s_by_task": {t: sum(r.get(f"groups/{t}", 0) for r in measured) * per_group for t in tasks},
        "step_s": window_s / len(measured),
        "trainer_idle_frac": statistics.fmean(r.get("trainer_idle_frac", 0.0) for r in measured),
        "stale_wait_frac": sum(r.get("stale_wait_s", 0.0) for r in measured) / window_s,
        "pools": {pool: {key.split("/", 2)[2]: value for key, value in last.items() if key.startswith(f"pool/{pool}/")}
                  for pool in pools},
        "evals": [{"version": e["version"], "time_s": _time_of(rows, e["version"]),
                   **{t: e[t] for t in tasks if t in e}} for e in evals],
        "accuracy_before_per_task": summary_json["accuracy_before_per_task"],
        "accuracy_after_per_task": summary_json["accuracy_after_per_task"],
        "groups_dropped": summary_json["groups_dropped"],
        "dropped_by_status": summary_json["dropped_by_status"],
    }


def _time_of(rows: list[dict[str, Any]], version: int) -> float:
    """When the trainer made `version` (0: its first step's start is not recorded; the job's start)."""
    return next((r["time_s"] for r in rows if r["step"] == version), 0.0)


def time_to(evals: list[dict[str, Any]], target: float) -> float | None:
    """The first evaluation's time at which the mean success over the tasks reached `target`."""
    for e in evals:
        successes = [v for k, v in e.items() if k not in ("version", "time_s")]
        if successes and statistics.fmean(successes) >= target:
            return e["time_s"]
    return None


def summary(rows: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """Per flaky setting: each arm's mean trajectories/s, idle fraction and time to the target, the pipeline's speed-up
    over the barrier; and per task, the pipeline's trajectories/s with the faults on over off."""
    if target is None:  # ten points over the base's mean success
        first = rows[0]["evals"][0]
        target = statistics.fmean(v for k, v in first.items() if k not in ("version", "time_s")) + 0.10
    out: dict[str, Any] = {"target": target}
    for is_flaky in (True, False):
        setting = {}
        for arm in ARMS:
            cells = [r for r in rows if r["arm"] == arm and r["flaky"] == is_flaky]
            times = [time_to(r["evals"], target) for r in cells]
            setting[arm] = {"trajectories_per_s": statistics.fmean(r["trajectories_per_s"] for r in cells),
                            "trainer_idle_frac": statistics.fmean(r["trainer_idle_frac"] for r in cells),
                            "step_s": statistics.fmean(r["step_s"] for r in cells),
                            "time_to_target_s": times}
        setting["speedup"] = setting["pipeline"]["trajectories_per_s"] / setting["barrier"]["trajectories_per_s"]
        setting["speedup_over_trl"] = setting["pipeline"]["trajectories_per_s"] / setting["trl"]["trajectories_per_s"]
        out["flaky" if is_flaky else "steady"] = setting
    pipeline = {flaky: [r for r in rows if r["arm"] == "pipeline" and r["flaky"] == flaky] for flaky in (True, False)}
    tasks = rows[0]["trajectories_per_s_by_task"]
    out["pipeline_flaky_over_steady_by_task"] = {
        t: statistics.fmean(r["trajectories_per_s_by_task"][t] for r in pipeline[True])
        / max(statistics.fmean(r["trajectories_per_s_by_task"][t] for r in pipeline[False]), 1e-9) for t in tasks}
    return out


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="agentic: the multi-environment job, pipeline against barrier")
    for column in ("arm", "flaky", "seed", "trajectories/s", "step s", "trainer idle", "stale wait",
                   "before -> after (per task)", "wall min"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        tasks = r["accuracy_after_per_task"]
        change = ", ".join(f"{t} {r['accuracy_before_per_task'][t]:.0%}->{tasks[t]:.0%}" for t in tasks)
        table.add_row(r["arm"], "on" if r["flaky"] else "off", str(r["seed"]), f"{r['trajectories_per_s']:.1f}",
                      f"{r['step_s']:.3f}", f"{r['trainer_idle_frac']:.0%}", f"{r['stale_wait_frac']:.0%}", change,
                      f"{r['wall_s'] / 60:.1f}")
    console = Console()
    console.print(table)
    s = result["summary"]
    console.print(f"pipeline over barrier: {s['flaky']['speedup']:.2f}x with the flaky environment, "
                  f"{s['steady']['speedup']:.2f}x without; over TRL: {s['flaky']['speedup_over_trl']:.2f}x and "
                  f"{s['steady']['speedup_over_trl']:.2f}x; target {s['target']:.0%}")
