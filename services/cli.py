"""The `jetroll` command: one subcommand per service, plus run, init-model and bench. Heavy imports are late."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from shared.config import ConfigError, JobConfig, load_config, validate_config

SERVICES = ("controller", "rollout", "reward", "trainer")


def _config_args(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("config", nargs=None if required else "?", help="job config YAML (configs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config field, e.g. --set trainer.lr=1e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetroll", description="FP8 end-to-end, disaggregated RL post-training")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a whole job locally: private redis-server + every service as a process")
    _config_args(run, required=True)
    run.add_argument("--max-steps", type=int, help="override trainer.max_steps")
    run.add_argument("--run-dir", type=Path, help="where metrics, summary and the weight store go (runs/<job_id>)")
    run.add_argument("--redis-url", help="use this Redis instead of starting a private redis-server")

    init = sub.add_parser("init-model", help="build (or find in the cache) the tiny warm-started base model")
    _config_args(init)
    init.add_argument("--force", action="store_true", help="rebuild even if cached")

    for name in SERVICES:
        svc = sub.add_parser(name, help=f"run the {name} service (the launcher starts these)")
        svc.add_argument("--config", type=Path, required=True, help="resolved job config JSON from the launcher")
        svc.add_argument("--redis-url", required=True)
        svc.add_argument("--consumer", default=name, help="consumer name in the stream's consumer group")
        svc.add_argument("--run-dir", type=Path, required=True)
        if name == "rollout":
            svc.add_argument("--pool", help="the rollout pool to serve (default: the first in rollout.pools)")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser("engine", help="jetroll engine vs transformers generate() tokens/s")
    engine.add_argument("--json", action="store_true", help="print one JSON object")
    engine.add_argument("--batch-sizes", default="1,16,64")
    engine.add_argument("--new-tokens", type=int, default=256)
    engine.add_argument("--repeats", type=int, default=3)
    engine.add_argument("--threads", type=int, default=2)
    engine.add_argument("--no-compile", action="store_true", help="eager decode (skips torch.compile)")
    store = bench_sub.add_parser("store", help="weight store publish+fetch vs the essential work (local, S3)")
    store.add_argument("--json", action="store_true", help="print one JSON object")
    store.add_argument("--synthetic-mb", type=int, default=200, help="size of the synthetic checkpoint's shard")
    store.add_argument("--repeats", type=int, default=5)
    store.add_argument("--multipart-threshold-mib", type=int, help="S3 files this big go multipart (default: store's)")
    bench_async = bench_sub.add_parser("async", help="async (eta 0, 1, 2, 4) vs sync speedup at cv 0.5, 1, 2 on the "
                                       "timing models, through the real services")
    bench_async.add_argument("--json", action="store_true", help="print one JSON object")
    bench_async.add_argument("--quick", action="store_true", help="one small setting (cv 1, eta 2): a smoke test")
    bench_async.add_argument("--seed", type=int, default=0, help="seed of the length draws")
    bench_async.add_argument("--run-dir", type=Path, help="keep every setting's run here (default: a temp dir)")
    reward = bench_sub.add_parser("reward", help="reward backends local | celery | lambda: rewards/s, p50/p99 latency")
    reward.add_argument("--json", action="store_true", help="print one JSON object")
    reward.add_argument("--concurrency", default="1,8,32", help="calls kept in flight, comma-separated")
    reward.add_argument("--calls", type=int, default=400, help="calls per backend and concurrency level")
    reward.add_argument("--workers", type=int, default=4, help="executors per backend (processes, environments)")
    reward.add_argument("--backends", default="local,celery,lambda", help="comma-separated")
    mismatch = bench_sub.add_parser("mismatch", help="training-inference log-prob mismatch by precision mode and "
                                    "rollout length (exact backend)")
    mismatch.add_argument("--json", action="store_true", help="print one JSON object")
    mismatch.add_argument("--lengths", default="128,256,512,1024,2048", help="completion lengths, comma-separated")
    mismatch.add_argument("--samples", type=int, default=8, help="sampled completions, scored by every mode")
    mismatch.add_argument("--threads", type=int, default=1)
    mismatch.add_argument("--model", help="an HF-format model dir instead of the random tiny model")
    precision = bench_sub.add_parser("precision", help="RL runs of bf16, fp8_unified and fp8_rollout_only per seed: "
                                     "held-out scores and reward curves (resumable)")
    precision.add_argument("--json", action="store_true", help="print one JSON object")
    precision.add_argument("--seeds", type=int, default=3, help="seeds per mode")
    precision.add_argument("--run-dir", type=Path, default=Path("runs/bench-precision"),
                           help="finished runs here are kept and not run again")
    precision.add_argument("--max-steps", type=int, help="override the pinned step count (smoke tests)")
    precision.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                           help="override a field of configs/precision_bench.yaml (smoke tests)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        if args.command == "run":
            from services.launcher import run_job

            config = load_config(args.config, args.overrides)
            if args.max_steps is not None:
                config = validate_config({**config.model_dump(), "trainer": {
                    **config.trainer.model_dump(), "max_steps": args.max_steps}})
            return run_job(config, run_dir=args.run_dir, redis_url=args.redis_url)
        if args.command == "init-model":
            from services.init_model import main as init_main

            init_main(load_config(args.config, args.overrides).model, force=args.force)
            return 0
        if args.command == "bench":
            return _bench(args)
        return _serve(args)
    except ConfigError as exc:
        print(f"jetroll: {exc}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "precision":
        from services.bench import precision

        result = precision.run_precision_bench(args.seeds, args.run_dir, args.max_steps, args.overrides)
        if args.json:
            print(json.dumps(result))
        else:
            precision.print_table(result)
        return 0
    if args.bench == "async":
        from services.bench import async_

        result = async_.run_async_bench(quick=args.quick, seed=args.seed, run_dir=args.run_dir)
        if args.json:
            print(json.dumps(result))
        else:
            async_.print_table(result)
        return 0
    if args.bench == "mismatch":
        from services.bench import mismatch

        result = mismatch.run_mismatch_bench(lengths=tuple(int(n) for n in args.lengths.split(",")),
                                             num_samples=args.samples, threads=args.threads,
                                             model_path=args.model)
        if args.json:
            print(json.dumps(result))
        else:
            mismatch.print_table(result)
        return 0
    if args.bench == "reward":
        from services.bench import reward

        result = reward.run_reward_bench(concurrency=tuple(int(c) for c in args.concurrency.split(",")),
                                         num_calls=args.calls, workers=args.workers,
                                         backends=tuple(args.backends.split(",")))
        if args.json:
            print(json.dumps(result))
        else:
            reward.print_table(result)
        return 0
    if args.bench == "store":
        from services.bench import store

        result = store.run_store_bench(synthetic_mb=args.synthetic_mb, repeats=args.repeats,
                                       multipart_threshold_mib=args.multipart_threshold_mib)
        if args.json:
            print(json.dumps(result))
        else:
            store.print_table(result)
        return 0
    from services.bench.engine import print_table, run_engine_bench

    result = run_engine_bench(batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                              new_tokens=args.new_tokens, repeats=args.repeats, threads=args.threads,
                              compile=not args.no_compile)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def _serve(args: argparse.Namespace) -> int:
    config = validate_config(json.loads(args.config.read_text()))
    threads = {"rollout": config.rollout.threads, "reward": config.reward.threads,
               "trainer": config.trainer.threads, "controller": 1}[args.command]
    import torch

    torch.set_num_threads(threads)
    try:
        asyncio.run(_service_main(args.command, config, args.redis_url, args.consumer, args.run_dir,
                                  getattr(args, "pool", None)))
    except asyncio.CancelledError:
        return 143
    return 0


async def _service_main(name: str, config: JobConfig, redis_url: str, consumer: str, run_dir: Path,
                        pool: str | None = None) -> None:
    from shared.bus import RedisBus
    from shared.store import setup_store

    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    if name == "reward":
        from services.reward.main import run as run_reward

        assert config.model.path
        await run_reward(config, redis_url, config.model.path, consumer)
        return
    bus = RedisBus(redis_url, config.job_id, max_deliveries=config.redis.max_deliveries,
                   claim_idle_ms=config.redis.claim_idle_ms)
    store = setup_store(config.store, config.job_id, run_dir)
    try:
        if name == "trainer":
            from services.trainer.trainer import Trainer

            await Trainer(config, bus, store, consumer).run()
        elif name == "rollout":
            from services.rollout.worker import RolloutWorker

            await RolloutWorker(config, bus, store, consumer, pool).run()
        else:
            from services.controller.controller import Controller

            summary = await Controller(config, bus, store, run_dir).run()
            print(json.dumps({k: summary[k] for k in ("steps", "accuracy_before", "accuracy_after",
                                                      "rollout_tokens_per_s", "mismatch_mean_abs_logprob")}))
    finally:
        await bus.close()


if __name__ == "__main__":
    sys.exit(main())
