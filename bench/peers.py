"""`jetroll bench peers`: a job (the default one unless `--config` names another) in jetroll and in TRL's GRPOTrainer,
side by side in one invocation, per job seed and kernel variant.

Both sides start from one base per kernel variant (built once, outside the clocks, under that variant's kernels) and
train on the same problems in the same order with the same reward and algorithm (`trl_grpo.py` says how TRL is set
up). Each side runs as a subprocess; the bench samples the CPU seconds of its whole process tree once a second.

The clocks: time per step is (end of step N - end of step 1) / (N - 1), from jetroll's metrics rows and TRL's
step callback. Evaluation is off both clocks: jetroll keeps every `eval_every`-th version in its store
(`trainer.checkpoint_every`) and runs no evaluation of its own during the steps (`eval.every_steps=0`); TRL writes a
snapshot every `eval_every` steps, its time taken out of its clock. After a run, the bench scores every kept version
of both sides with the same greedy evaluation (`score_model_dir`) on the same held-out problems.

TRL runs at its best on-policy setting: each kernel variant first times short runs at each `--trl-threads` count and
keeps the fastest for its cells. A finished cell leaves `row.json` and is not run again, so the bench resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetroll.bench.learning import KERNELS, parse_seeds
from jetroll.bench.processes import descendants, processes, stop_like_ctrl_c
from jetroll.bench.resume import claim_run_dir
from jetroll.bench.rows import read_jsonl
from jetroll.bench.versions import jetroll_commit, library_versions
from jetroll.functions.scoring import job_tasks
from jetroll.shared.config.job import JobConfig, load_config, validate_config
from jetroll.shared.errors import ConfigError, WarmStartError

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "arithmetic.yaml"
DEFAULT_RUN_DIR = Path("~/.cache/jetroll/bench/peers")
SIDES = ("jetroll", "trl")
# issue 40's bars on the default job: jetroll's time per step and time to 80% as a fraction of TRL's, the stale wait's
# share of a step, the final accuracy (mean, lowest) and its distance from TRL's; on the second job, time per step alone
MAX_STEP_RATIO, MAX_T80_RATIO, MAX_STALE_SHARE = 0.87, 0.87, 0.05
MIN_MEAN_FINAL, MIN_FINAL, MAX_FINAL_GAP = 0.81, 0.79, 0.02
OTHER_JOB_MAX_STEP_RATIO = 1 / 1.5
SAMPLE_EVERY_S = 1.0


def require_trl(bench: str = "peers") -> None:
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"bench {bench} needs TRL, and {exc.name} does not import: pip install 'jetroll[peers]'") \
            from None


@dataclass(frozen=True, slots=True)
class PeerJob:
    """The job both sides run: its config file and overrides, and the accuracies whose crossing times are reported."""

    path: Path
    overrides: list[str]
    thresholds: tuple[float, ...]

    def load(self, *more: str) -> JobConfig:
        return load_config(self.path, [*self.overrides, *more])

    @property
    def set_args(self) -> list[str]:
        return [arg for item in self.overrides for arg in ("--set", item)]


def run_peers_bench(steps: int | None = None, seeds: str = "2", kernels: str = "native,avx2",
                    run_dir: Path | None = None, overrides: list[str] = (), eval_every: int = 100,
                    eval_problems: int = 1000, trl_threads: str = "1,2", probe_steps: int = 40,
                    config_path: Path = CONFIG, thresholds: str = "0.7,0.8") -> dict[str, Any]:
    require_trl()
    seed_list = parse_seeds(seeds)
    names = [k.strip() for k in kernels.split(",") if k.strip()]
    if unknown := [n for n in names if n not in KERNELS]:
        raise ConfigError(f"bench peers --kernels: unknown kernel variant(s) {unknown}; valid: {sorted(KERNELS)}")
    threads = [int(t) for t in trl_threads.split(",") if t.strip()]
    try:
        levels = tuple(sorted(float(t) for t in thresholds.split(",") if t.strip()))
    except ValueError:
        raise ConfigError(f"bench peers --thresholds {thresholds!r}: accuracies in (0, 1], comma-separated") from None
    if not levels or not all(0 < t <= 1 for t in levels):
        raise ConfigError(f"bench peers --thresholds {thresholds!r}: accuracies in (0, 1], comma-separated")
    job = PeerJob(Path(config_path).resolve(), [*overrides, *([f"trainer.max_steps={steps}"] if steps else [])],
                  levels)
    config = job.load()  # a bad config or override fails here, before any cell runs
    num_steps = config.trainer.max_steps
    if not 1 <= eval_every <= num_steps or num_steps < 2:
        raise ConfigError(f"bench peers: --eval-every {eval_every} must lie in [1, steps] and steps "
                          f"({num_steps}) be at least 2")
    run_dir = Path(run_dir or DEFAULT_RUN_DIR).expanduser().resolve()
    settings = {"overrides": job.overrides, "eval_every": eval_every, "eval_problems": eval_problems,
                "trl_threads": threads, "probe_steps": probe_steps, "thresholds": list(levels)}
    claim_run_dir(run_dir, {"config": job.path.read_text(), **settings}, "peers", "other settings")
    rows, probes = [], {}
    for kernel in names:
        kernel_dir = run_dir / kernel
        base = build_base(kernel, kernel_dir, job)
        probes[kernel] = trl_thread_probe(kernel, kernel_dir, base, job, threads, probe_steps)
        for seed in seed_list:
            for side in SIDES:
                out = kernel_dir / f"{side}-s{seed}"
                if not (out / "row.json").exists():
                    run_cell(side, kernel, seed, out, base, job, eval_every, eval_problems,
                             probes[kernel]["best_threads"], config)
                rows.append(json.loads((out / "row.json").read_text()))
    result = {"config": {"config": str(job.path), **settings, "seeds": seed_list, "kernels": names,
                         "run_dir": str(run_dir)},
              "versions": library_versions(), "trl_thread_probes": probes, "rows": rows,
              "summary": summary(rows, names, levels, is_default_job=job.path == CONFIG.resolve())}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def kernel_env(kernel: str, kernel_dir: Path) -> dict[str, str]:
    return {**os.environ, **KERNELS[kernel], "TORCHINDUCTOR_CACHE_DIR": str(kernel_dir / "inductor")}


def build_base(kernel: str, kernel_dir: Path, job: PeerJob) -> Path:
    """The kernel variant's base (the job's warm start under its kernels), built once, outside every clock."""
    from jetroll.shared.warm_start import ensure_base_model

    cache = kernel_dir / "cache"
    command = [sys.executable, "-m", "jetroll.services.cli", "init-model", str(job.path),
               "--set", f"model.cache_dir={cache}", *job.set_args]
    print(f"bench peers: {kernel}: the base ...", file=sys.stderr, flush=True)
    code = subprocess.run(command, env=kernel_env(kernel, kernel_dir), stdout=subprocess.DEVNULL).returncode
    if code != 0:  # init-model printed why
        raise WarmStartError(f"bench peers: {kernel}: building the base failed (init-model exited {code})")
    config = job.load(f"model.cache_dir={cache}")
    return ensure_base_model(config.model, job_tasks(config), progress=False)


def trl_thread_probe(kernel: str, kernel_dir: Path, base: Path, job: PeerJob, threads: list[int],
                     probe_steps: int) -> dict[str, Any]:
    """Time TRL's step at each thread count on a short run (its first quarter is warm-up); the fastest wins."""
    path = kernel_dir / "trl-threads.json"
    if path.exists():
        return json.loads(path.read_text())
    per_step = {}
    for count in threads:
        out = kernel_dir / f"trl-threads-{count}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        spec = {"config": str(job.path), "overrides": job.overrides, "base_dir": str(base), "out_dir": str(out),
                "seed": 0, "steps": probe_steps, "threads": count, "snapshot_every": probe_steps}
        (out / "spec.json").write_text(json.dumps(spec))
        command = [sys.executable, "-m", "jetroll.bench.trl_grpo", str(out / "spec.json")]
        run_logged(command, kernel_env(kernel, kernel_dir), out, out / "steps.jsonl")
        clock = read_jsonl(out / "steps.jsonl")
        warm = clock[max(1, probe_steps // 4)]
        per_step[count] = (clock[-1]["wall_s"] - warm["wall_s"]) / (clock[-1]["step"] - warm["step"])
        print(f"bench peers: {kernel}: TRL with {count} threads: {per_step[count]:.4f} s/step", file=sys.stderr,
              flush=True)
    probe = {"s_per_step": per_step, "best_threads": min(per_step, key=per_step.get), "steps": probe_steps}
    path.write_text(json.dumps(probe, indent=2))
    return probe


class TreeSampler:
    """Once a second: the CPU seconds of each process under `root` (named by service), and the steps done so far
    (lines of `progress`)."""

    def __init__(self, root: int, progress: Path, out: Path) -> None:
        self.root, self.progress, self.out = root, progress, out
        self.samples: list[dict[str, Any]] = []
        # a process keeps the name it was first given by its service: an exiting one has no command line left
        self.names = {root: "launcher"}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.wait(SAMPLE_EVERY_S):
            self.samples.append(self.sample())

    def sample(self) -> dict[str, Any]:
        table = processes()
        cpu: dict[str, float] = {}
        for process in descendants(self.root, table):  # parents come before their children
            parent = table.get(process.parent)
            forked = parent is not None and process.args == parent.args  # not exec'd (yet): its parent's copy
            if process.service and not forked:
                self.names.setdefault(process.pid, process.service)
            name = self.names.get(process.pid) or f"{self.names.get(process.parent, 'other')}/child"
            cpu[name] = cpu.get(name, 0.0) + process.cpu_s
        try:
            lines = self.progress.read_text().count("\n")
        except OSError:
            lines = 0
        return {"wall_s": time.perf_counter(), "lines": lines, "cpu_s": cpu}

    def stop(self) -> list[dict[str, Any]]:
        self.stopped.set()
        self.thread.join()
        with open(self.out / "cpu.jsonl", "w") as file:
            file.writelines(json.dumps(s) + "\n" for s in self.samples)
        return self.samples


def run_logged(command: list[str], env: dict[str, str], out: Path, progress: Path) -> list[dict[str, Any]]:
    """Run one side to its end, its output in `out/job.log`, its process tree sampled; the samples."""
    with open(out / "job.log", "wb") as log:
        job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = TreeSampler(job.pid, progress, out)
        try:
            code = job.wait()
        except BaseException:  # interrupted: let a jetroll job stop its services and Redis
            stop_like_ctrl_c(job)
            raise
        finally:
            samples = sampler.stop()
    if code != 0:
        raise RuntimeError(f"bench peers: {out.name} failed (exit {code}); see {out / 'job.log'}")
    return samples


def run_cell(side: str, kernel: str, seed: int, out: Path, base: Path, job: PeerJob, eval_every: int,
             eval_problems: int, trl_threads: int, config: JobConfig) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = kernel_env(kernel, out.parent)
    print(f"bench peers: {kernel}: {side} seed {seed} ...", file=sys.stderr, flush=True)
    commit = jetroll_commit()
    if side == "jetroll":
        command = [sys.executable, "-m", "jetroll.services.cli", "run", str(job.path), "--run-dir", str(out / "run"),
                   "--set", f"model.cache_dir={out.parent / 'cache'}", "--set", f"seed={seed}",
                   "--set", f"trainer.checkpoint_every={eval_every}", "--set", "eval.every_steps=0", *job.set_args]
        samples = run_logged(command, env, out, out / "run" / "metrics.jsonl")
        row = read_jetroll(out, samples, eval_every, eval_problems, base, config, job.thresholds)
    else:
        spec = {"config": str(job.path), "overrides": job.overrides, "base_dir": str(base), "out_dir": str(out),
                "seed": seed, "steps": config.trainer.max_steps, "threads": trl_threads, "snapshot_every": eval_every}
        (out / "spec.json").write_text(json.dumps(spec))
        command = [sys.executable, "-m", "jetroll.bench.trl_grpo", str(out / "spec.json")]
        samples = run_logged(command, env, out, out / "steps.jsonl")
        row = read_trl(out, samples, eval_every, eval_problems, base, config, job.thresholds) | {"threads": trl_threads}
    row |= {"side": side, "kernel": kernel, "seed": seed, "commit": commit}
    (out / "row.json").write_text(json.dumps(row, indent=2))
    print(f"bench peers: {kernel}: {side} seed {seed}: {row['s_per_step']:.4f} s/step, final {row['final']:.1%}",
          file=sys.stderr, flush=True)


def evaluation(config: JobConfig, directories: dict[int, Path], eval_problems: int) -> list[list[float]]:
    """[[step, accuracy], ...] of each step's HF directory on the first task's held-out problems."""
    from jetroll.shared.evaluate import score_model_dir

    name, tasks = config.tasks[0].name, job_tasks(config)
    problems = {name: tasks[name].heldout(eval_problems)}
    return [[step, score_model_dir(directory, config, tasks, problems)[name]] for step, directory in
            sorted(directories.items())]


def cpu_window(samples: list[dict[str, Any]], first_line: int) -> dict[str, Any]:
    """CPU over the steps: from the first sample that saw step 1 done to the first that saw the last one."""
    started = next(s for s in samples if s["lines"] >= first_line)
    # the first sample at the last step, or, if a service had exited by then (its CPU seconds gone with it), the last
    # one that still saw every process the window started with
    ended = next(s for s in samples if s["lines"] == samples[-1]["lines"])
    if not started["cpu_s"].keys() <= ended["cpu_s"].keys():
        ended = next(s for s in reversed(samples) if started["cpu_s"].keys() <= s["cpu_s"].keys())
    steps = ended["lines"] - started["lines"]
    wall = ended["wall_s"] - started["wall_s"]
    per_service = {name: (ended["cpu_s"].get(name, 0.0) - started["cpu_s"].get(name, 0.0)) / max(steps, 1)
                   for name in ended["cpu_s"]}
    total = sum(per_service.values())
    return {"core_s_per_step": total, "core_s_per_step_by_process": per_service,
            "cpu_utilisation": total * steps / wall / os.cpu_count() if wall > 0 else None}


def crossing(evals: list[list[float]], times: dict[int, float], threshold: float) -> float | None:
    """Seconds from the end of step 1 to the first evaluated step at or above `threshold` (None: never)."""
    step = next((s for s, accuracy in evals if accuracy >= threshold and s >= 1), None)
    return None if step is None else times[step] - times[1]


def time_key(threshold: float) -> str:
    return f"time_to_{threshold * 100:g}_s"


def _timing(times: dict[int, float], evals: list[list[float]], thresholds: tuple[float, ...]) -> dict[str, Any]:
    last = max(times)
    return {"steps": last, "s_per_step": (times[last] - times[1]) / (last - 1), "evals": evals,
            "base": evals[0][1], "final": evals[-1][1],
            **{time_key(t): crossing(evals, times, t) for t in thresholds}}


def read_jetroll(out: Path, samples: list[dict[str, Any]], eval_every: int, eval_problems: int, base: Path,
                 config: JobConfig, thresholds: tuple[float, ...]) -> dict[str, Any]:
    import asyncio

    from jetroll.shared.store import setup_store

    metrics = read_jsonl(out / "run" / "metrics.jsonl")
    times = {row["step"]: row["time_s"] for row in metrics}
    run_config = validate_config(json.loads((out / "run" / "config.json").read_text()))
    store = setup_store(run_config.store, run_config.job_id, out / "run")
    held = asyncio.run(store.versions())
    wanted = [v for v in held if v % eval_every == 0 or v == max(times)]

    async def fetch_all() -> dict[int, Path]:
        return {v: Path(await store.fetch(v)) for v in wanted if v > 0}

    evals = evaluation(config, {0: base, **asyncio.run(fetch_all())}, eval_problems)
    n = len(metrics)
    mean = {key: sum(row.get(key, 0.0) for row in metrics) / n for key in
            ("step_time_s", "stage_s", "commit_wait_s", "trainer_wait_s", "stale_wait_s", "num_policy_tokens")}
    row = _timing(times, evals, thresholds)
    last = metrics[-1]
    return {**row, **cpu_window(samples, first_line=1), "trainer": {k: mean[k] for k in mean if k.endswith("_s")},
            "stale_wait_share": mean["stale_wait_s"] / row["s_per_step"],
            "completions_per_s": config.trainer.groups_per_step * config.trainer.group_size / row["s_per_step"],
            "tokens_per_s": mean["num_policy_tokens"] / row["s_per_step"],
            # busy decode slots over all slots: how full rollout's batch ran, not how much of its time it worked
            "rollout_slot_occupancy": last["rollout_busy_slot_s"] / last["rollout_slot_s"]}


def read_trl(out: Path, samples: list[dict[str, Any]], eval_every: int, eval_problems: int, base: Path,
             config: JobConfig, thresholds: tuple[float, ...]) -> dict[str, Any]:
    clock = read_jsonl(out / "steps.jsonl")
    times = {row["step"]: row["wall_s"] for row in clock if row["step"] >= 1}
    snapshots = {int(p.name.removeprefix("step-")): p for p in (out / "snapshots").iterdir()}
    evals = evaluation(config, {0: base, **{s: p for s, p in snapshots.items() if s > 0}}, eval_problems)
    logs = read_jsonl(out / "logs.jsonl")
    lengths = [row["completions/mean_length"] for row in logs if "completions/mean_length" in row]
    row = _timing(times, evals, thresholds)
    completions = config.trainer.groups_per_step * config.trainer.group_size
    # line 1 of steps.jsonl is the start of training, line 2 the end of step 1
    return {**row, **cpu_window(samples, first_line=2),
            "completions_per_s": completions / row["s_per_step"],
            "tokens_per_s": completions * sum(lengths) / max(len(lengths), 1) / row["s_per_step"]}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else _mean(values)


def summary(rows: list[dict[str, Any]], kernels: list[str], thresholds: tuple[float, ...],
            is_default_job: bool = True) -> dict[str, Any]:
    """Per kernel variant: each side's means over seeds, jetroll's ratios to TRL and the bars (issue 40's four on the
    default job; time per step alone on any other)."""
    per_kernel = {}
    for kernel in kernels:
        side = {name: [r for r in rows if r["kernel"] == kernel and r["side"] == name] for name in SIDES}
        if not all(side.values()):
            continue
        means = {name: {"s_per_step": _mean([r["s_per_step"] for r in side[name]]),
                        "core_s_per_step": _mean([r["core_s_per_step"] for r in side[name]]),
                        "final": _mean([r["final"] for r in side[name]]),
                        "min_final": min(r["final"] for r in side[name]),
                        **{time_key(t): _mean_or_none([r[time_key(t)] for r in side[name]]) for t in thresholds}}
                 for name in SIDES}
        jet, trl = means["jetroll"], means["trl"]
        step_ratio = jet["s_per_step"] / trl["s_per_step"]
        time_ratios = {time_key(t): None if None in (jet[time_key(t)], trl[time_key(t)])
                       else jet[time_key(t)] / trl[time_key(t)] for t in thresholds}
        stale = max(r["stale_wait_share"] for r in side["jetroll"])
        if is_default_job:
            t80_ratio = time_ratios.get(time_key(0.8))
            bars = {"step_ratio": step_ratio <= MAX_STEP_RATIO,
                    "time_to_80_ratio": t80_ratio is not None and t80_ratio <= MAX_T80_RATIO,
                    "stale_wait_share": stale <= MAX_STALE_SHARE,
                    "final": jet["final"] >= MIN_MEAN_FINAL and jet["min_final"] >= MIN_FINAL
                    and abs(jet["final"] - trl["final"]) <= MAX_FINAL_GAP}
        else:
            bars = {"step_ratio": step_ratio <= OTHER_JOB_MAX_STEP_RATIO}
        per_kernel[kernel] = {"means": means, "step_ratio": step_ratio, "speedup": 1 / step_ratio,
                              "time_ratios": time_ratios, "max_stale_wait_share": stale, "bars": bars,
                              "all_pass": all(bars.values())}
    return {"per_kernel": per_kernel, "all_pass": bool(per_kernel) and all(k["all_pass"] for k in per_kernel.values()),
            "commits": sorted({str(r["commit"]) for r in rows})}


def timeline_table(rows: list[dict[str, Any]]) -> Any:
    """Where one step's time goes: each process's CPU per step, and jetroll's trainer cycle by phase (ms)."""
    from rich.table import Table

    processes = sorted({name for r in rows for name in r["core_s_per_step_by_process"]})
    phases = ("trainer_wait_s", "stale_wait_s", "step_time_s", "stage_s", "commit_wait_s")
    table = Table(title="one step: CPU ms per process, and the trainer's cycle by phase (wall ms; the stale wait is "
                        "part of the trainer's wait)")
    for column in ("kernel", "side", "seed", "wall ms", *processes, *(p.removesuffix("_s") for p in phases)):
        table.add_column(column, justify="right")
    for r in rows:
        cpu = r["core_s_per_step_by_process"]
        trainer = r.get("trainer", {})
        table.add_row(r["kernel"], r["side"], str(r["seed"]), f"{r['s_per_step'] * 1000:.1f}",
                      *(f"{cpu[p] * 1000:.1f}" if p in cpu else "-" for p in processes),
                      *(f"{trainer[p] * 1000:.1f}" if p in trainer else "-" for p in phases))
    return table


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"peers: jetroll vs TRL GRPOTrainer ({result['config']['eval_problems']} held-out problems "
                        f"every {result['config']['eval_every']} steps)")
    thresholds = result["config"]["thresholds"]
    for column in ("kernel", "side", "seed", "threads", "s/step", "core-s/step", "CPU %",
                   *(f"to {t:.0%} s" for t in thresholds), "base", "final", "tokens/s", "stale wait %"):
        table.add_column(column, justify="right")

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for r in result["rows"]:
        utilisation = "-" if r["cpu_utilisation"] is None else f"{r['cpu_utilisation']:.0%}"
        table.add_row(r["kernel"], r["side"], str(r["seed"]), str(r.get("threads", "-")), f"{r['s_per_step']:.4f}",
                      f"{r['core_s_per_step']:.3f}", utilisation, *(seconds(r[time_key(t)]) for t in thresholds),
                      f"{r['base']:.1%}", f"{r['final']:.1%}", f"{r['tokens_per_s']:.0f}",
                      f"{r['stale_wait_share']:.1%}" if "stale_wait_share" in r else "-")
    console = Console(width=200)  # two wide tables: a pipe or a narrow terminal would cut their columns
    console.print(table)
    console.print(timeline_table(result["rows"]))
    for kernel, s in result["summary"]["per_kernel"].items():
        times = ", ".join(f"to {t:.0%} {'-' if ratio is None else f'{ratio:.2f}'}"
                          for t, ratio in zip(thresholds, s["time_ratios"].values(), strict=True))
        console.print(f"{kernel}: jetroll/TRL time per step {s['step_ratio']:.2f} ({s['speedup']:.2f}x), time {times}, "
                      f"stale wait {s['max_stale_wait_share']:.1%} of a step; bars: "
                      + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in s["bars"].items()))
