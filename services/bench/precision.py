"""`jetroll bench precision`: RL runs of bf16, fp8_unified and fp8_rollout_only without a behaviour correction, and of
fp8_rollout_only with the token_tis and icepop corrections, one per arm and seed.

Every run is the job of configs/precision_bench.yaml through the real local launcher; only precision.mode,
precision.correction and the seeds differ. The task mix includes the long-output `count32` task, so rollouts are long.
A finished run leaves its summary.json and metrics.jsonl under the bench's run dir and is not run again, so the bench
resumes across sessions. It reports each run's held-out score before and after, the per-arm mean and std, the reward
curves and a PNG plot.
"""

from __future__ import annotations

import json
import logging
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from jetroll.services.bench.async_ import launch_job
from jetroll.services.launch.redis_server import RedisServer
from jetroll.shared.config.job import load_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.warm_start import ensure_base_model

log = logging.getLogger("jetroll.bench.precision")

# (precision.mode, precision.correction): every mode uncorrected, then the corrections of the failing baseline
ARMS = (("bf16", "none"), ("fp8_unified", "none"), ("fp8_rollout_only", "none"),
        ("fp8_rollout_only", "token_tis"), ("fp8_rollout_only", "icepop"))
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "precision_bench.yaml"
CURVE_WINDOW = 10  # steps in the moving average of a reward curve


def run_precision_bench(num_seeds: int, run_dir: Path, max_steps: int | None = None,
                        overrides: list[str] = ()) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    base = load_config(CONFIG, [*overrides, *([f"trainer.max_steps={max_steps}"] if max_steps else [])])
    _claim(run_dir, base.model_dump(mode="json", exclude={"job_id"}))  # each run gets its own job_id
    model_path = str(Path(ensure_base_model(base.model)).resolve())
    runs = []
    server = None
    try:
        for seed in range(num_seeds):
            for mode, correction in ARMS:
                out = run_dir / f"{mode}-{correction}-seed{seed}"
                if not (out / "summary.json").exists():
                    server = server or RedisServer().start()
                    started = time.perf_counter()
                    log.info("running %s seed %d (%d steps)", arm(mode, correction), seed, base.trainer.max_steps)
                    run_one(base.model_dump(mode="json"), mode, correction, seed, model_path, out, server.url)
                    log.info("%s seed %d done in %.0f s", arm(mode, correction), seed, time.perf_counter() - started)
                runs.append(read_run(out, mode, correction, seed))
    finally:
        if server is not None:
            server.stop()
    result = {"config": {"num_seeds": num_seeds, "max_steps": base.trainer.max_steps,
                         "tasks": [t.name for t in base.tasks], "run_dir": str(run_dir),
                         "machine": platform.machine(), "python": platform.python_version()},
              "runs": runs, "summary": _summary(runs)}
    plot(runs, run_dir / "precision.png")
    result["plot"] = str(run_dir / "precision.png")
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _claim(run_dir: Path, tree: dict[str, Any]) -> None:
    """Pin the run dir to one bench config, so a resumed bench never mixes runs of different configs."""
    path = run_dir / "bench_config.json"
    if path.exists() and json.loads(path.read_text()) != tree:
        raise ConfigError(f"{run_dir} holds precision-bench runs of another config ({path}); pass a new --run-dir")
    path.write_text(json.dumps(tree, indent=2))


def arm(mode: str, correction: str) -> str:
    """An arm's name: the mode, with the correction after a + when there is one."""
    return mode if correction == "none" else f"{mode}+{correction}"


def run_one(tree: dict[str, Any], mode: str, correction: str, seed: int, model_path: str, out: Path,
            redis_url: str) -> None:
    """One (mode, correction, seed) job; a half-written run dir from an interrupted session starts over."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tree = {**tree, "job_id": f"prec-{mode}-{correction}-s{seed}-{int(time.time())}", "seed": seed,
            "model": {**tree["model"], "path": model_path},
            "precision": {**tree["precision"], "mode": mode, "correction": correction},
            "store": {**tree["store"], "root": str(out / "store")}}
    launch_job(tree, out, redis_url)


def read_run(out: Path, mode: str, correction: str, seed: int) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"arm": arm(mode, correction), "mode": mode, "correction": correction, "seed": seed,
            "score_before": 100 * summary["accuracy_before"], "score_after": 100 * summary["accuracy_after"],
            "score_after_per_task": {k: 100 * v for k, v in summary["accuracy_after_per_task"].items()},
            "wall_time_s": summary["wall_time_s"],
            "mismatch_mean_abs_logprob": summary["mismatch_mean_abs_logprob"],
            "reward_curve": [r.get("reward_mean", float("nan")) for r in rows]}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    arms = [arm(mode, correction) for mode, correction in ARMS]
    scores = {name: [r["score_after"] for r in runs if r["arm"] == name] for name in arms}
    mean = {name: statistics.fmean(s) for name, s in scores.items()}
    bf16_std = statistics.stdev(scores["bf16"]) if len(scores["bf16"]) > 1 else 0.0
    gap = mean["fp8_unified"] - mean["bf16"]
    return {
        "score_mean": mean,
        "score_std": {name: statistics.stdev(s) if len(s) > 1 else 0.0 for name, s in scores.items()},
        "unified_minus_bf16": gap,
        "bf16_std": bf16_std,
        "rollout_only_minus_bf16": mean["fp8_rollout_only"] - mean["bf16"],
        "rollout_only_token_tis_minus_bf16": mean["fp8_rollout_only+token_tis"] - mean["bf16"],
        "rollout_only_icepop_minus_bf16": mean["fp8_rollout_only+icepop"] - mean["bf16"],
        "unified_within_tolerance": abs(gap) <= max(1.0, bf16_std),
    }


def smooth(values: list[float]) -> list[float]:
    return [statistics.fmean(values[max(0, i - CURVE_WINDOW + 1):i + 1]) for i in range(len(values))]


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, scores) = plt.subplots(1, 2, figsize=(13, 4.5))
    arms = [arm(mode, correction) for mode, correction in ARMS]
    colors = dict(zip(arms, ("tab:blue", "tab:green", "tab:red", "tab:orange", "tab:purple"), strict=True))
    for run in runs:
        curves.plot(smooth(run["reward_curve"]), color=colors[run["arm"]], alpha=0.8,
                    label=run["arm"] if run["seed"] == 0 else None)
    curves.set(xlabel="step", ylabel=f"train reward (moving mean of {CURVE_WINDOW})", title="reward curves")
    curves.legend()
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
    scores.set_xticklabels([name.replace("+", "\n+") for name in arms], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"precision: RL runs of {result['config']['max_steps']} steps on "
                  f"{'+'.join(result['config']['tasks'])} (held-out score, points)")
    for column in ("mode", "correction", "seed", "before", "after", *result["runs"][0]["score_after_per_task"],
                   "|Δlogp|", "wall s"):
        table.add_column(column, justify="right")
    for run in result["runs"]:
        table.add_row(run["mode"], run["correction"], str(run["seed"]), f"{run['score_before']:.1f}",
                      f"{run['score_after']:.1f}",
                      *(f"{v:.1f}" for v in run["score_after_per_task"].values()),
                      f"{run['mismatch_mean_abs_logprob']:.1e}", f"{run['wall_time_s']:.0f}")
    console = Console()
    console.print(table)
    summary = result["summary"]
    console.print(f"fp8_unified - bf16: {summary['unified_minus_bf16']:+.2f} points (bf16 std "
                  f"{summary['bf16_std']:.2f}; within tolerance: {summary['unified_within_tolerance']}); "
                  f"fp8_rollout_only - bf16: {summary['rollout_only_minus_bf16']:+.2f} points (with token_tis "
                  f"{summary['rollout_only_token_tis_minus_bf16']:+.2f}, with icepop "
                  f"{summary['rollout_only_icepop_minus_bf16']:+.2f}); plot {result['plot']}")
