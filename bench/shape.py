"""`jetroll bench shape`: a real-vocabulary job at Qwen2.5-0.5B's exact shape (`configs/bench_qwen2.5_0.5b.yaml`:
random weights, bf16, 2 groups of 4 samples, no eval), run as `jetroll run` runs it, with what each process costs.

Each process's peak RSS is its kernel high-water mark (VmHWM), read from /proc while it lives (twice a second, so
the last half second of a process that exits on its own can be missed); a service's figure sums its processes. The
job's own peak is the most its processes held together at one poll (a base build in the launcher comes before the
services start, so the sum of every process's peak overstates it).
Where the time goes comes from the job's own metrics: the trainer's step, its weight staging and its waits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jetroll.bench.processes import processes

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "bench_qwen2.5_0.5b.yaml"
MODEL = ROOT / "configs" / "models" / "qwen2.5-0.5b-shape"
GIB = 1024**3


def run_shape_bench(layers: int | None = None, max_steps: int | None = None, run_dir: Path | None = None,
                    overrides: list[str] = ()) -> dict[str, Any]:
    out = Path(run_dir or tempfile.mkdtemp(prefix="jetroll-shape-")).resolve()
    shutil.rmtree(out / "run", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = MODEL if layers is None else with_layers(out / "model", layers)
    extra = [f"model.path={model_dir}", f"model.cache_dir={out / 'cache'}", *overrides,
             *([f"trainer.max_steps={max_steps}"] if max_steps else [])]
    command = [sys.executable, "-m", "jetroll.services.cli", "run", str(CONFIG), "--run-dir", str(out / "run"),
               *(arg for item in extra for arg in ("--set", item))]
    print(f"bench shape: {' '.join(command)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    peaks: dict[int, tuple[str, int]] = {}  # pid -> (service, VmHWM bytes)
    peak_together = 0  # the most the job's processes held at one poll, together
    with open(out / "job.log", "wb") as log:
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while job.poll() is None:
            together = 0
            for pid, service in _processes(job.pid).items():
                if (memory := _memory(pid)) is not None:
                    peaks[pid] = (service, max(memory["VmHWM"], peaks.get(pid, (service, 0))[1]))
                    together += memory["VmRSS"]
            peak_together = max(peak_together, together)
            time.sleep(0.5)
    wall_s = time.perf_counter() - started
    if job.returncode != 0:
        raise RuntimeError(f"bench shape: the job failed (exit {job.returncode}); see {out / 'job.log'}")
    by_service: dict[str, int] = {}
    for service, peak in peaks.values():
        by_service[service] = by_service.get(service, 0) + peak
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    config = json.loads((model_dir / "config.json").read_text())
    build = json.loads(next((out / "cache").glob("random-*/random_init.json")).read_text())
    return {
        "config": {"config": str(CONFIG), "model": str(model_dir), "overrides": extra, "run_dir": str(out),
                   "num_hidden_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
                   "vocab_size": config["vocab_size"], "parameters": build["parameters"]},
        "peak_rss_gib": {service: round(peak / GIB, 2) for service, peak in sorted(by_service.items())},
        "peak_rss_sum_gib": round(sum(by_service.values()) / GIB, 2),  # each process at its own peak: a bound
        "peak_rss_together_gib": round(peak_together / GIB, 2),
        "steps": [{key: row.get(key) for key in ("step", "step_time_s", "stage_s", "commit_wait_s",
                                                 "trainer_wait_s", "rollout_tokens_per_s")} for row in rows],
        "base_build_s": build["wall_s"],
        "wall_s": round(wall_s, 1),
    }


def with_layers(directory: Path, layers: int) -> Path:
    """The shape's model dir with another layer count (CI's short run): everything else as it ships."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(MODEL, directory)
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = config["max_window_layers"] = layers
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _processes(root: int) -> dict[int, str]:
    """Every live process under `root`, by the service it belongs to: the nearest ancestor that is `jetroll <service>`
    (the launcher is `run`), or `redis` for the job's Redis."""
    table = processes()
    found = {}
    for pid in table:
        chain = [pid]  # pid, its parent, ... up to root if pid is under it
        while chain[-1] != root and chain[-1] in table and len(chain) < 64:
            chain.append(table[chain[-1]].parent)
        if chain[-1] == root:
            found[pid] = next((s for p in chain if p in table and (s := table[p].service)), "run")
    return found


def _memory(pid: int) -> dict[str, int] | None:
    """VmRSS and VmHWM (the peak) of a live process, in bytes."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    found = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.startswith(("VmRSS", "VmHWM"))}
    return found if len(found) == 2 else None


def print_table(result: dict[str, Any]) -> None:
    config = result["config"]
    print(f"{config['parameters']:,} parameters ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']:,}); base build {result['base_build_s']:.0f} s, job {result['wall_s']:.0f} s")
    print("peak RSS: " + ", ".join(f"{service} {gib:.2f} GiB" for service, gib in result["peak_rss_gib"].items())
          + f"; together at most {result['peak_rss_together_gib']:.2f} GiB (sum of peaks "
          f"{result['peak_rss_sum_gib']:.2f} GiB)")
    print(f"{'step':>4} {'train s':>8} {'stage s':>8} {'commit wait s':>14} {'trainer wait s':>15} "
          f"{'rollout tok/s':>14}")
    for row in result["steps"]:
        print(f"{row['step']:>4} " + " ".join(f"{row[key] or 0:>{width}.2f}" for key, width in (
            ("step_time_s", 8), ("stage_s", 8), ("commit_wait_s", 14), ("trainer_wait_s", 15),
            ("rollout_tokens_per_s", 14))))
