"""`jetroll bench precision`: RL runs of each precision arm, one per arm and seed, reporting the rollout/trainer
mismatch's level and its growth over training, per task, the first step each mismatch gate trips, and held-out scores.

Every run is the job of configs/precision_bench.yaml through the real local launcher; only the arm's precision fields
and the seed differ. The job is sync mode, so every row is measured at the version that sampled it, and its gates only
warn, so each run goes to the end and records when each gate would have stopped it. The tasks are arithmetic and the
long-output `count32`: two generation lengths. A finished run leaves its summary.json and metrics.jsonl under the
bench's run dir and is not run again, so the bench resumes across sessions.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from jetroll.bench.async_ import launch_job
from jetroll.bench.resume import claim_run_dir
from jetroll.bench.rows import read_jsonl
from jetroll.functions.scoring import job_tasks
from jetroll.services.launch.redis_server import RedisServer
from jetroll.shared.config.job import JobConfig, config_tree, load_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.rl.mismatch import Growth, k3_growth
from jetroll.shared.warm_start import ensure_base_model

log = logging.getLogger("jetroll.bench.precision")

# each arm's precision fields over the config's; the misaligned refit quantizes a bf16 copy while the trainer's
# forward quantizes the fp32 masters (a quiet failure no byte or plan check sees: the gates must)
ARMS: dict[str, dict[str, str]] = {
    "bf16": {"mode": "bf16"},
    "fp8_unified": {"mode": "fp8_unified", "backend": "fast"},
    "fp8_unified_exact": {"mode": "fp8_unified", "backend": "exact"},
    "fp8_rollout_only": {"mode": "fp8_rollout_only"},
    "misaligned": {"mode": "fp8_unified", "backend": "fast", "refit_source": "bf16_copy"},
    "fp8_rollout_only+token_tis": {"mode": "fp8_rollout_only", "correction": "token_tis"},
    "fp8_rollout_only+icepop": {"mode": "fp8_rollout_only", "correction": "icepop"},
}
DEFAULT_ARMS = ("bf16", "fp8_unified", "fp8_unified_exact", "fp8_rollout_only", "misaligned")
GATES = ("k3", "abs_mean", "growth")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "precision_bench.yaml"
CURVE_WINDOW = 10  # steps in the moving average of a reward curve


def run_precision_bench(num_seeds: int, run_dir: Path, max_steps: int | None = None, overrides: list[str] = (),
                        arms: tuple[str, ...] = DEFAULT_ARMS) -> dict[str, Any]:
    unknown = [name for name in arms if name not in ARMS]
    if unknown:
        raise ConfigError(f"unknown precision-bench arm(s) {unknown}; the arms are {list(ARMS)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    base = load_config(CONFIG, [*overrides, *([f"trainer.max_steps={max_steps}"] if max_steps else [])])
    # each run gets its own job_id
    claim_run_dir(run_dir, base.model_dump(mode="json", exclude={"job_id"}), "precision")
    model_path = str(Path(ensure_base_model(base.model, job_tasks(base))).resolve())
    runs = []
    server = None
    try:
        for seed in range(num_seeds):
            for name in arms:
                out = run_dir / f"{name}-seed{seed}"
                if not (out / "summary.json").exists():
                    server = server or RedisServer().start()
                    started = time.perf_counter()
                    log.info("running %s seed %d (%d steps)", name, seed, base.trainer.max_steps)
                    run_one(config_tree(base), name, seed, model_path, out, server.url)
                    log.info("%s seed %d done in %.0f s", name, seed, time.perf_counter() - started)
                runs.append(read_run(out, name, seed, base))
    finally:
        if server is not None:
            server.stop()
    result = {"config": {"num_seeds": num_seeds, "max_steps": base.trainer.max_steps, "arms": list(arms),
                         "tasks": [t.name for t in base.tasks], "run_dir": str(run_dir),
                         "growth": base.precision.mismatch.gate.growth.model_dump(mode="json"),
                         "machine": platform.machine(), "python": platform.python_version()},
              "runs": runs, "summary": _summary(runs, arms)}
    plot(runs, arms, run_dir / "precision.png")
    result["plot"] = str(run_dir / "precision.png")
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def run_one(tree: dict[str, Any], name: str, seed: int, model_path: str, out: Path, redis_url: str) -> None:
    """One (arm, seed) job; a half-written run dir from an interrupted session starts over."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tree = {**tree, "job_id": f"prec-{name.replace('+', '-')}-s{seed}-{int(time.time())}", "seed": seed,
            "model": {**tree["model"], "path": model_path},
            "precision": {**tree["precision"], **ARMS[name]},
            "store": {**tree["store"], "root": str(out / "store")}}
    launch_job(tree, out, redis_url)


def read_run(out: Path, name: str, seed: int, config: JobConfig) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    rows = read_jsonl(out / "metrics.jsonl")
    growth = config.precision.mismatch.gate.growth
    measured = [r for r in rows if "mismatch/k3" in r]
    per_task = {}
    for task in (t.name for t in config.tasks):
        task_rows = [r for r in measured if math.isfinite(r.get(f"mismatch/task/{task}/k3", math.nan))]
        k3s = [r[f"mismatch/task/{task}/k3"] for r in task_rows]
        task_growth = k3_growth(k3s, growth.window, growth.floor)
        per_task[task] = {
            "measured_steps": len(task_rows),
            "k3_median": statistics.median(k3s) if k3s else None,
            "abs_mean_median": statistics.median(r[f"mismatch/task/{task}/abs_mean"] for r in task_rows)
            if task_rows else None,
            "growth_final": task_growth.ratio if task_growth else None,
            **_windows(task_growth),
        }
    k3s = [r["mismatch/k3"] for r in measured]
    growths = [r["mismatch/growth"] for r in measured if "mismatch/growth" in r]
    precision = json.loads((out / "config.json").read_text())["precision"]  # what the job ran with
    return {"arm": name, "seed": seed,
            **{field: precision[field] for field in ("mode", "backend", "refit_source", "correction")},
            "score_before": 100 * summary["accuracy_before"], "score_after": 100 * summary["accuracy_after"],
            "score_after_per_task": {k: 100 * v for k, v in summary["accuracy_after_per_task"].items()},
            "wall_time_s": summary["wall_time_s"],
            "mismatch_mean_abs_logprob": summary["mismatch_mean_abs_logprob"],
            "measured_steps": len(measured), "steps": len(rows),
            "k3_median": statistics.median(k3s) if k3s else None, "k3_max": max(k3s) if k3s else None,
            "growth_final": growths[-1] if growths else None, "growth_max": max(growths) if growths else None,
            **_windows(k3_growth(k3s, growth.window, growth.floor)),
            "k3_curve": k3s, "per_task": per_task,
            # the first step at which each gate tripped (every gate warns in this bench), None if it never did
            "first_trip": {gate: next((r["step"] for r in rows if f"mismatch_gate/{gate}" in r), None)
                           for gate in GATES},
            "reward_curve": [r.get("reward_mean", math.nan) for r in rows]}


def _windows(growth: Growth | None) -> dict[str, float | None]:
    """k3's mean over the first and the latest windows the growth compares, unfloored: growth as a level moves."""
    return {"k3_first": growth.baseline if growth else None, "k3_last": growth.latest if growth else None}


def _summary(runs: list[dict[str, Any]], arms: tuple[str, ...]) -> dict[str, Any]:
    """Per arm, over its seeds: the mismatch's level and growth, when each gate first tripped, and the scores."""
    per_arm = {}
    for name in arms:
        of_arm = [r for r in runs if r["arm"] == name]
        scores = [r["score_after"] for r in of_arm]
        per_arm[name] = {
            "score_mean": statistics.fmean(scores),
            "score_std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
            "k3_median": _median(r["k3_median"] for r in of_arm),
            "k3_first": _median(r["k3_first"] for r in of_arm), "k3_last": _median(r["k3_last"] for r in of_arm),
            "growth_final": _median(r["growth_final"] for r in of_arm),
            "growth_max": max((r["growth_max"] for r in of_arm if r["growth_max"] is not None), default=None),
            "first_trip": {gate: [r["first_trip"][gate] for r in of_arm] for gate in GATES},
            "per_task": {task: {key: _median(r["per_task"][task][key] for r in of_arm)
                                for key in ("k3_median", "abs_mean_median", "growth_final", "k3_first", "k3_last")}
                         for task in of_arm[0]["per_task"]},
        }
    summary: dict[str, Any] = {"arms": per_arm}
    if "bf16" in per_arm:
        summary["score_minus_bf16"] = {name: a["score_mean"] - per_arm["bf16"]["score_mean"]
                                       for name, a in per_arm.items() if name != "bf16"}
        summary["bf16_std"] = per_arm["bf16"]["score_std"]
    return summary


def _median(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def smooth(values: list[float]) -> list[float]:
    return [statistics.fmean(values[max(0, i - CURVE_WINDOW + 1):i + 1]) for i in range(len(values))]


def plot(runs: list[dict[str, Any]], arms: tuple[str, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mismatch, curves, scores) = plt.subplots(1, 3, figsize=(18, 4.5))
    colors = dict(zip(arms, plt.get_cmap("tab10").colors, strict=False))
    for run in runs:
        label = run["arm"] if run["seed"] == 0 else None
        if run["k3_curve"]:
            mismatch.plot([max(k3, 1e-12) for k3 in run["k3_curve"]], color=colors[run["arm"]], alpha=0.8,
                          label=label)
        curves.plot(smooth(run["reward_curve"]), color=colors[run["arm"]], alpha=0.8, label=label)
    mismatch.set(xlabel="measured step", ylabel="mismatch k3 (0 drawn at 1e-12)", yscale="log",
                 title="rollout / trainer mismatch per step")
    mismatch.legend(fontsize=8)
    curves.set(xlabel="step", ylabel=f"train reward (moving mean of {CURVE_WINDOW})", title="reward curves")
    for i, name in enumerate(arms):
        values = [r["score_after"] for r in runs if r["arm"] == name]
        scores.scatter([i] * len(values), values, color=colors[name])
        if values:
            scores.hlines(statistics.fmean(values), i - 0.2, i + 0.2, color=colors[name])
    before = [r["score_before"] for r in runs]
    if before:
        scores.axhline(statistics.fmean(before), color="gray", linestyle="--", label="base model")
        scores.legend()
    scores.set(xticks=range(len(arms)), ylabel="held-out score (points)", title="final held-out score per seed")
    scores.set_xticklabels([name.replace("+", "\n+").replace("_", "\n", 1) for name in arms], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _figure(value: float | None, spec: str = ".1e") -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    tasks = config["tasks"]
    table = Table(title=f"precision: sync RL runs of {config['max_steps']} steps on {'+'.join(tasks)}; mismatch k3 "
                  "(median over steps), its growth at the end (trainer's rule), first step each gate tripped")
    for column in ("arm", "seed", "k3", "k3 first->last", *(f"k3 {t}" for t in tasks), "growth",
                   "max growth", *(f"trip {g}" for g in GATES), "score before", "after", "wall s"):
        table.add_column(column, justify="right")
    for run in result["runs"]:
        table.add_row(run["arm"], str(run["seed"]), _figure(run["k3_median"]),
                      f"{_figure(run['k3_first'])}->{_figure(run['k3_last'])}",
                      *(_figure(run["per_task"][t]["k3_median"]) for t in tasks), _figure(run["growth_final"], ".2f"),
                      _figure(run["growth_max"], ".2f"), *(str(run["first_trip"][g] or "-") for g in GATES),
                      f"{run['score_before']:.1f}", f"{run['score_after']:.1f}", f"{run['wall_time_s']:.0f}")
    console = Console(width=max(Console().width, 180))  # the table is wide; a pipe gets 80 columns
    console.print(table)
    for name, arm in result["summary"]["arms"].items():
        trips = ", ".join(f"{g} {arm['first_trip'][g]}" for g in GATES)
        console.print(f"{name}: k3 {_figure(arm['k3_median'])}, growth {_figure(arm['growth_final'], '.2f')} (max "
                      f"{_figure(arm['growth_max'], '.2f')}), first trips per seed: {trips}; score "
                      f"{arm['score_mean']:.2f} +- {arm['score_std']:.2f}")
    console.print(f"plot {result['plot']}")
