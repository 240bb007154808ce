"""`jetroll bench NAME`: each benchmark as a plug-in that declares its arguments and its run. A bench's module is
imported only when it runs (they import torch, vLLM, boto3)."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from jetroll.shared.config.base import comma_ints


@dataclass(frozen=True, slots=True)
class Bench:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[ModuleType, argparse.Namespace], dict[str, Any]]  # (its module, the parsed args) -> result
    module: str  # under jetroll.bench


def _overrides(parser: argparse.ArgumentParser, config: str) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a field of {config}")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="eager decode (skips torch.compile)")
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM column (default: one if vLLM is installed)")
    parser.add_argument("--swap-shapes", default="tiny,wide", help="models whose swap cost is timed (with vLLM): "
                        "tiny (the bench's) and wide (hidden 1024, 8 layers)")


def _engine_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_engine_bench(batch_sizes=comma_ints(args.batch_sizes, "--batch-sizes"), new_tokens=args.new_tokens,
                              repeats=args.repeats, threads=args.threads, compile=not args.no_compile,
                              include_vllm=False if args.no_vllm else None,
                              swap_shapes=tuple(args.swap_shapes.split(",")))


def _store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--synthetic-mb", type=int, default=200, help="size of the synthetic checkpoint's shard")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--multipart-threshold-mib", type=int, help="S3 files this big go multipart (default: "
                        "store's)")


def _store_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_store_bench(synthetic_mb=args.synthetic_mb, repeats=args.repeats,
                             multipart_threshold_mib=args.multipart_threshold_mib)


def _async_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one small setting (cv 1, eta 2): a smoke test")
    parser.add_argument("--seed", type=int, default=0, help="seed of the length draws")
    parser.add_argument("--run-dir", type=Path, help="keep every setting's run here (default: a temp dir)")


def _async_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_async_bench(quick=args.quick, seed=args.seed, run_dir=args.run_dir)


def _reward_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default="1,8,32", help="calls kept in flight, comma-separated")
    parser.add_argument("--calls", type=int, default=400, help="calls per backend and concurrency level")
    parser.add_argument("--workers", type=int, default=4, help="executors per backend (processes, environments)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated (default: local,inline,celery, and lambda when --lambda-endpoint is "
                        "given)")
    parser.add_argument("--lambda-endpoint", default=None,
                        help="a Lambda Invoke API the lambda backend calls (AWS's, or a local one)")


def _reward_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_reward_bench(concurrency=comma_ints(args.concurrency, "--concurrency"), num_calls=args.calls,
                              workers=args.workers, lambda_endpoint=args.lambda_endpoint,
                              backends=tuple(args.backends.split(",")) if args.backends else None)


def _mismatch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="128,256,512,1024,2048", help="completion lengths, comma-separated")
    parser.add_argument("--samples", type=int, default=8, help="sampled completions, scored by every mode")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", help="an HF-format model dir instead of the random tiny model")


def _mismatch_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_mismatch_bench(lengths=comma_ints(args.lengths, "--lengths"), num_samples=args.samples,
                                threads=args.threads, model_path=args.model)


def _learning_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", default="3", help="job seeds (and warm-start seeds) per kernel: a count N "
                        "(seeds 0 .. N-1) or a comma-separated list (3,4; one seed: 3,)")
    parser.add_argument("--kernels", default="avx2,native",
                        help="kernel variants, comma-separated, in run order: avx2, native")
    parser.add_argument("--run-dir", type=Path, help="finished cells here are kept and not run again (default "
                        "~/.cache/jetroll/bench/learning)")
    parser.add_argument("--max-steps", type=int, help="override trainer.max_steps (a short proxy or a smoke test)")
    _overrides(parser, "configs/arithmetic.yaml in every cell")


def _learning_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_learning_bench(args.seeds, args.kernels, args.run_dir, args.overrides, args.max_steps)


def _chaos_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="the job's seed, and the fault schedule's")
    parser.add_argument("--run-dir", type=Path, help="a finished run here is kept and not run again (default "
                        "~/.cache/jetroll/bench/chaos)")
    parser.add_argument("--max-steps", type=int, help="override trainer.max_steps (a smoke test)")
    parser.add_argument("--outage-s", type=float, default=30.0, help="how long S3 stays unreachable")
    parser.add_argument("--fault-free", type=int, default=0, metavar="N", help="also N runs of the same job "
                        "without faults (each resumable), and the faulted run's distance from their mean accuracy")
    parser.add_argument("--s3-endpoint", help="an S3-compatible endpoint for the job's store (default: a moto "
                        "server started by the bench, when moto is installed)")
    _overrides(parser, "configs/arithmetic.yaml")


def _chaos_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_chaos_bench(args.seed, args.run_dir, args.overrides, args.max_steps, args.outage_s,
                             args.s3_endpoint, args.fault_free)


def _shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's 24; CI runs 2)")
    parser.add_argument("--max-steps", type=int, help="override trainer.max_steps")
    parser.add_argument("--run-dir", type=Path, help="the run, its model cache and its log (default: a temp dir)")
    _overrides(parser, "configs/bench_qwen2.5_0.5b.yaml")


def _shape_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_shape_bench(args.layers, args.max_steps, args.run_dir, args.overrides)


def _precision_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench-precision"),
                        help="finished runs here are kept and not run again")
    parser.add_argument("--max-steps", type=int, help="override the pinned step count (smoke tests)")
    parser.add_argument("--arms", help="comma-separated arms (default: the first five) of bf16, fp8_unified (fast "
                        "backend), fp8_unified_exact, fp8_rollout_only, misaligned (fp8_unified refitting from a bf16 "
                        "copy), fp8_rollout_only+token_tis, fp8_rollout_only+icepop")
    _overrides(parser, "configs/precision_bench.yaml (smoke tests)")


def _precision_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    arms = tuple(args.arms.split(",")) if args.arms else m.DEFAULT_ARMS
    return m.run_precision_bench(args.seeds, args.run_dir, args.max_steps, args.overrides, arms)


def _peers_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, help="override trainer.max_steps (default: the job's 3000)")
    parser.add_argument("--seeds", default="2", help="job seeds per kernel: a count N (seeds 0 .. N-1) or a "
                        "comma-separated list (3,4; one seed: 3,)")
    parser.add_argument("--kernels", default="native,avx2", help="kernel variants, comma-separated: native, avx2")
    parser.add_argument("--run-dir", type=Path, help="finished cells here are kept and not run again (default "
                        "~/.cache/jetroll/bench/peers)")
    parser.add_argument("--eval-every", type=int, default=100, help="evaluate both sides every N steps")
    parser.add_argument("--eval-problems", type=int, default=1000, help="held-out problems per evaluation")
    parser.add_argument("--trl-threads", default="1,2", help="TRL's torch thread counts to time; the fastest runs")
    parser.add_argument("--probe-steps", type=int, default=40, help="steps of each TRL thread-count probe")
    parser.add_argument("--config", type=Path, help="the job both sides run, single-task (default: "
                        "configs/arithmetic.yaml; issue 40's second job is configs/dataset_math.yaml)")
    parser.add_argument("--thresholds", default="0.7,0.8", help="held-out accuracies whose crossing times are "
                        "reported, comma-separated")
    _overrides(parser, "the job's config on both sides")


def _peers_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_peers_bench(args.steps, args.seeds, args.kernels, args.run_dir, args.overrides, args.eval_every,
                             args.eval_problems, args.trl_threads, args.probe_steps, args.config or m.CONFIG,
                             args.thresholds)


def _agentic_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=2, help="job seeds per cell (seeds 0 .. N-1)")
    parser.add_argument("--run-dir", type=Path, help="finished cells here are kept and not run again (default "
                        "~/.cache/jetroll/bench/agentic)")
    parser.add_argument("--max-steps", type=int, help="override trainer.max_steps (a smoke test)")
    parser.add_argument("--target", type=float, help="the mean held-out success whose time is reported (default: "
                        "the base's mean plus 0.10)")
    parser.add_argument("--trl-steps", type=int, help="steps of the TRL arm (default: the job's trainer.max_steps)")
    _overrides(parser, "configs/agentic.yaml in every cell")


def _agentic_run(m: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    return m.run_agentic_bench(args.seeds, args.run_dir, args.overrides, args.max_steps, args.target,
                               args.trl_steps)


BENCHES = {
    "engine": Bench("jetroll engine vs transformers generate() tokens/s", _engine_args, _engine_run, "engine"),
    "store": Bench("weight store publish+fetch vs the essential work (local, S3)", _store_args, _store_run, "store"),
    "async": Bench("async (eta 0, 1, 2, 4) vs sync speedup at cv 0.5, 1, 2 on the timing models, through the real "
                   "services", _async_args, _async_run, "async_"),
    "reward": Bench("reward backends local | celery | lambda: rewards/s, p50/p99 latency", _reward_args, _reward_run,
                    "reward"),
    "mismatch": Bench("training-inference log-prob mismatch by precision mode and rollout length (exact backend)",
                      _mismatch_args, _mismatch_run, "mismatch"),
    "learning": Bench("the default job per job seed x kernel variant, each from a cold model cache: base, final and "
                      "lowest accuracy, wall time (resumable)", _learning_args, _learning_run, "learning"),
    "chaos": Bench("the default async job under a seeded schedule of faults (kill -9 of every service, the trainer "
                   "twice, a Redis kill, an S3 outage): recovery times and an audit of admitted, trained once or "
                   "twice, dropped and lost groups (resumable)", _chaos_args, _chaos_run, "chaos"),
    "shape": Bench("a job at Qwen2.5-0.5B's exact shape with random weights (configs/bench_qwen2.5_0.5b.yaml, 3 "
                   "steps): peak RSS per service, step times", _shape_args, _shape_run, "shape"),
    "precision": Bench("sync RL runs per precision arm and seed (bf16, fp8_unified fast and exact, fp8_rollout_only, "
                       "a misaligned refit): the mismatch's level and growth per task, the first step each gate "
                       "trips, held-out scores (resumable)",
                       _precision_args, _precision_run, "precision"),
    "peers": Bench("the default job in jetroll and in TRL's GRPOTrainer side by side, per job seed x kernel variant: "
                   "time per step, core-seconds, time to 70%% and 80%%, final accuracy (resumable)", _peers_args,
                   _peers_run, "peers"),
    "agentic": Bench("the multi-environment job (configs/agentic.yaml) under the trajectory-level pipeline and a "
                     "barrier loop, with its flaky environment on and off: trajectories/s, the trainer's idle "
                     "fraction, env set-up share, time to a target success (resumable)", _agentic_args, _agentic_run,
                     "agentic"),
}


def add_bench_parsers(sub: Any) -> None:
    """`jetroll bench NAME ...` for every bench, each with `--json` and its own arguments."""
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, spec in BENCHES.items():
        parser = bench_sub.add_parser(name, help=spec.help)
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        spec.add_arguments(parser)


def run_bench(args: argparse.Namespace) -> int:
    """Run one benchmark (its module imported now), then print its JSON object or its table."""
    from jetroll.bench.versions import library_versions

    spec = BENCHES[args.bench]
    module = importlib.import_module(f"jetroll.bench.{spec.module}")
    result = spec.run(module, args)
    result.setdefault("versions", library_versions())
    if args.json:
        print(json.dumps(result))
    else:
        module.print_table(result)
    return 0
