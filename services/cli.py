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

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser("engine", help="jetroll engine vs transformers generate() tokens/s")
    engine.add_argument("--json", action="store_true", help="print one JSON object")
    engine.add_argument("--batch-sizes", default="1,16,64")
    engine.add_argument("--new-tokens", type=int, default=256)
    engine.add_argument("--repeats", type=int, default=3)
    engine.add_argument("--threads", type=int, default=2)
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
    from services.bench.engine import print_table, run_engine_bench

    result = run_engine_bench(batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                              new_tokens=args.new_tokens, repeats=args.repeats, threads=args.threads)
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
        asyncio.run(_service_main(args.command, config, args.redis_url, args.consumer, args.run_dir))
    except asyncio.CancelledError:
        return 143
    return 0


async def _service_main(name: str, config: JobConfig, redis_url: str, consumer: str, run_dir: Path) -> None:
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

            await RolloutWorker(config, bus, store, consumer).run()
        else:
            from services.controller.controller import Controller

            summary = await Controller(config, bus, store, run_dir).run()
            print(json.dumps({k: summary[k] for k in ("steps", "accuracy_before", "accuracy_after",
                                                      "rollout_tokens_per_s", "mismatch_mean_abs_logprob")}))
    finally:
        await bus.close()


if __name__ == "__main__":
    sys.exit(main())
