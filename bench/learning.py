"""`jetroll bench learning`: the default job over a matrix of job seeds, warm-start seeds and CPU kernels.

Each cell is README command 1 as a new user runs it: `jetroll run configs/arithmetic.yaml` in a subprocess, from
cold model and inductor caches of its own, so its wall time counts the base build and the compiles. The `avx2`
kernel variant runs the cell with ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS set to AVX2:
other float kernels, so other bits, a stand-in for another machine. Warm-start seeds are spread over the cells so
that several bases are covered.

A finished cell leaves `row.json` and is not run again, so the bench resumes across sessions; a cell that was
interrupted starts over from an empty directory (only uninterrupted runs count for time).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from jetroll.bench.processes import run_job
from jetroll.bench.resume import claim_run_dir
from jetroll.bench.rows import read_jsonl
from jetroll.bench.versions import jetroll_commit, library_versions
from jetroll.shared.config.job import load_config
from jetroll.shared.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "arithmetic.yaml"
DEFAULT_RUN_DIR = Path("~/.cache/jetroll/bench/learning")
KERNELS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
# the acceptance bar of a cell (issue 14): final accuracy, rise over the base, largest dip below it, wall time
MIN_FINAL, MIN_RISE, MAX_DIP, MAX_WALL_S = 0.80, 0.25, 0.02, 20 * 60


def cells(seeds: list[int], kernels: list[str]) -> list[dict[str, Any]]:
    """Job seed x kernel; kernel k pairs each seed with the warm-start seed k places on in `seeds`, so each kernel
    builds other bases too. The default runs the AVX2 cells first: the stand-in for another machine, and the slowest
    bases to build."""
    return [{"kernel": kernel, "seed": seed, "warm_start_seed": seeds[(i + k) % len(seeds)]}
            for k, kernel in enumerate(kernels) for i, seed in enumerate(seeds)]


def parse_seeds(text: str) -> list[int]:
    """`--seeds`: a count N (seeds 0 .. N-1) or a comma-separated list of distinct seeds (one seed: "S,")."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"bench learning --seeds: {text!r} is neither a count nor a comma-separated list of "
                          "integers") from None
    seeds = values if "," in text else list(range(values[0] if values else 0))
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ConfigError(f"bench learning --seeds: {text!r} names no seed, a negative one or one twice")
    return seeds


def run_learning_bench(seeds: str = "3", kernels: str = "avx2,native", run_dir: Path | None = None,
                       overrides: list[str] = (), max_steps: int | None = None) -> dict[str, Any]:
    seed_list = parse_seeds(seeds)
    names = [k.strip() for k in kernels.split(",") if k.strip()]
    for name in names:
        if name not in KERNELS:
            raise ConfigError(f"bench learning --kernels: unknown kernel variant {name!r}; valid: {sorted(KERNELS)}")
    run_dir = Path(run_dir or DEFAULT_RUN_DIR).expanduser().resolve()
    extra = [*overrides, *([f"trainer.max_steps={max_steps}"] if max_steps else [])]
    load_config(CONFIG, extra)  # a bad override fails here, before any cell runs
    claim_run_dir(run_dir, {"config": CONFIG.read_text(), "overrides": extra}, "learning")
    rows = []
    for cell in cells(seed_list, names):
        out = run_dir / f"{cell['kernel']}-s{cell['seed']}-w{cell['warm_start_seed']}"
        if not (out / "row.json").exists():
            run_cell(cell, out, extra)
        rows.append(json.loads((out / "row.json").read_text()))
    result = {"config": {"config": str(CONFIG), "overrides": extra, "seeds": seed_list, "kernels": names,
                         "run_dir": str(run_dir)},
              "versions": library_versions(), "rows": rows, "summary": summary(rows)}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def run_cell(cell: dict[str, Any], out: Path, overrides: list[str]) -> None:
    """One cell from an empty directory: its own cold model and inductor caches, its kernel variables, the whole job
    timed."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "jetroll.services.cli", "run", str(CONFIG), "--run-dir", str(out / "run"),
               "--set", f"model.cache_dir={out / 'cache'}", "--set", f"seed={cell['seed']}",
               "--set", f"model.warm_start.seed={cell['warm_start_seed']}",
               *(arg for item in overrides for arg in ("--set", item))]
    env = {**os.environ, **KERNELS[cell["kernel"]], "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor")}
    capability = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                                env=env, capture_output=True, text=True, check=True).stdout.strip()
    print(f"bench learning: {out.name} ...", file=sys.stderr, flush=True)
    commit = jetroll_commit()  # the code the cell's job starts with
    code, wall_s = run_job(command, env, out / "job.log")
    if code != 0:
        raise RuntimeError(f"bench learning cell {out.name} failed (exit {code}); see {out / 'job.log'}")
    row = read_cell(cell, out, wall_s) | {"cpu_capability": capability, "commit": commit}
    (out / "row.json").write_text(json.dumps(row, indent=2))
    print(f"bench learning: {out.name}: {row['base']:.1%} -> {row['final']:.1%}, lowest {row['lowest']:.1%}, "
          f"{wall_s / 60:.1f} min", file=sys.stderr, flush=True)


def read_cell(cell: dict[str, Any], out: Path, wall_s: float) -> dict[str, Any]:
    summary = json.loads((out / "run" / "summary.json").read_text())
    evals = read_jsonl(out / "run" / "eval.jsonl")
    (base_dir,) = (out / "cache").glob("base-*")
    warm = json.loads((base_dir / "warmstart.json").read_text())
    base, final = summary["accuracy_before"], summary["accuracy_after"]
    accuracies = [_mean_accuracy(e) for e in evals]
    lowest = min(accuracies)
    row = {**cell, "base": base, "final": final, "rise": final - base, "lowest": lowest,
           "dip": max(0.0, base - lowest), "evals": [[e["version"], a] for e, a in zip(evals, accuracies, strict=True)],
           "warm_start_steps": warm["steps"], "warm_start_probe": warm["probe_history"][-1][1]
           if warm["probe_history"] else None, "base_build_s": warm["wall_s"], "rl_s": summary["wall_time_s"],
           "wall_s": round(wall_s, 1), "steps": summary["steps"], "eval_problems": summary["num_eval_problems"]}
    row["passes"] = (final >= MIN_FINAL and row["rise"] >= MIN_RISE and row["dip"] <= MAX_DIP
                     and wall_s <= MAX_WALL_S)
    return row


def _mean_accuracy(row: dict[str, float]) -> float:
    values = [v for k, v in row.items() if k != "version"]
    return sum(values) / len(values)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"min_final": min(r["final"] for r in rows), "min_rise": min(r["rise"] for r in rows),
            "max_dip": max(r["dip"] for r in rows), "max_wall_s": max(r["wall_s"] for r in rows),
            "num_cells": len(rows), "num_passing": sum(r["passes"] for r in rows),
            "all_pass": all(r["passes"] for r in rows),
            "commits": sorted({str(r["commit"]) for r in rows})}  # one commit: the matrix is one measurement


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    problems = sorted({n for r in result["rows"] for n in r.get("eval_problems", {}).values()})
    table = Table(title="learning: the default job per cell (held-out greedy accuracy, "
                        f"{'/'.join(map(str, problems)) or '?'} problems)")
    for column in ("kernel", "seed", "warm-start seed", "base", "final", "rise", "lowest", "warm-start steps",
                   "base build s", "wall min", "pass"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(r["kernel"], str(r["seed"]), str(r["warm_start_seed"]), f"{r['base']:.1%}",
                      f"{r['final']:.1%}", f"{r['rise'] * 100:+.1f}", f"{r['lowest']:.1%}", str(r["warm_start_steps"]),
                      f"{r['base_build_s']:.0f}", f"{r['wall_s'] / 60:.1f}", "yes" if r["passes"] else "NO")
    console = Console()
    console.print(table)
    s = result["summary"]
    console.print(f"min final {s['min_final']:.1%}, min rise {s['min_rise'] * 100:+.1f} points, max dip below the base "
                  f"{s['max_dip'] * 100:.1f} points, max wall {s['max_wall_s'] / 60:.1f} min; "
                  f"{s['num_passing']}/{s['num_cells']} cells pass")
