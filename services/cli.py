"""The `jetroll` command: one subcommand per service, plus run, submit, status, init-model, eval and bench. Heavy
imports are late."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import logging
import math
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from jetroll.bench.cli import add_bench_parsers, run_bench
from jetroll.services.launch.entrypoints import SERVICES, prepare_process, service_main, until_sigterm, watch_main
from jetroll.shared.config.base import comma_ints
from jetroll.shared.config.job import load_config, validate_config
from jetroll.shared.errors import JOB_FAILED_EXIT, ConfigError, JobFailedError, WarmStartError


def _config_args(parser: argparse.ArgumentParser, required: bool = False,
                 what: str = "job config YAML (configs/*.yaml)") -> None:
    parser.add_argument("config", nargs=None if required else "?", help=what)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config field, e.g. --set trainer.lr=1e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetroll", description="FP8 end-to-end, disaggregated RL post-training")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a whole job locally: private redis-server + every service as a process",
                         epilog="every config field, with its default and description: jetroll config [SECTION]")
    _config_args(run, required=True, what="job config YAML (configs/*.yaml), or an s3://bucket/key job (JSON or YAML)")
    run.add_argument("--max-steps", type=int, help="override trainer.max_steps")
    run.add_argument("--run-dir", type=Path, help="where metrics, summary and the weight store go (runs/<job_id>)")
    run.add_argument("--redis-url", default=os.environ.get("JETROLL_REDIS_URL"),
                     help="use this Redis instead of starting a private redis-server (env JETROLL_REDIS_URL; the "
                     "AWS Batch job gets ElastiCache's URL this way)")
    run.add_argument("--launcher", choices=("local", "ray"), default="local", help="local: services as processes "
                     "(default); ray: rollout pools as Ray Serve deployments, trainer and reward router as actors")
    run.add_argument("--ray-address", help="--launcher ray: join this Ray cluster (needs --redis-url or redis.url); "
                     "default: start a local one")
    run.add_argument("--ray-num-cpus", type=int, help="--launcher ray: CPUs of the local Ray cluster (default: all)")

    init = sub.add_parser("init-model", help="build (or find in the cache) the tiny warm-started base model")
    _config_args(init)
    init.add_argument("--force", action="store_true", help="rebuild even if cached")

    score = sub.add_parser("eval", help="score a finished job's published weights again on its tasks' held-out "
                           "problems, as its controller did (more problems: a finer figure), or on training problems")
    score.add_argument("run_dir", type=Path, help="the job's run dir (`jetroll run --run-dir`)")
    score.add_argument("--versions", help="comma-separated weight versions (default: those the job scored that its "
                       "store still holds)")
    score.add_argument("--num-problems", type=int, help="problems per task (default: the job's eval.num_problems)")
    score.add_argument("--split", choices=["heldout", "train"], default="heldout",
                       help="score held-out problems (the job's figure), or a fixed draw of the training split: "
                       "far higher accuracy there means the model learnt its problems, not the skill")
    score.add_argument("--json", action="store_true", help="print one JSON object")

    reference = sub.add_parser("config", help="every job config field: its type, default and description")
    reference.add_argument("section", nargs="?", help="only the fields under this dotted prefix, e.g. rollout or "
                           "model.warm_start")
    reference.add_argument("--json", action="store_true", help="print one JSON list")

    redis_url = os.environ.get("JETROLL_REDIS_URL")
    _add_queue_parsers(sub, redis_url)

    celery = sub.add_parser("celery-worker", help="a Celery reward worker (reward.backend celery) on the job's Redis")
    _config_args(celery)
    celery.add_argument("--redis-url", default=redis_url, help="the broker unless reward.celery_broker_url is set "
                        "(env JETROLL_REDIS_URL)")
    celery.add_argument("--node", help="worker node name (default jetroll@<hostname>)")

    _add_service_parsers(sub, redis_url)
    add_bench_parsers(sub)
    return parser


def _add_queue_parsers(sub: Any, redis_url: str | None) -> None:
    """`jetroll submit | status | dlq`: jobs queued for watch mode, their board, and a job's dead letters."""
    submit = sub.add_parser("submit", help="validate a job config and queue it for `jetroll controller --watch` "
                            "(Redis), or put it under an S3 jobs/ prefix (the AWS trigger); prints the job_id")
    _config_args(submit, required=True)
    submit.add_argument("--to", choices=("redis", "s3"), default="redis", help="where the job goes (default redis)")
    submit.add_argument("--redis-url", default=redis_url, help="--to redis: the stack's Redis (env JETROLL_REDIS_URL)")
    submit.add_argument("--jobs-uri", default=os.environ.get("JETROLL_JOBS_URI"), help="--to s3: s3://bucket/jobs/ "
                        "(env JETROLL_JOBS_URI); the job lands at <jobs-uri>/<job_id>.json")
    submit.add_argument("--endpoint-url", help="--to s3: an S3-compatible endpoint (default: AWS_ENDPOINT_URL, "
                        "else AWS)")

    status = sub.add_parser("status", help="submitted jobs: queued, running, done (with accuracy) or failed (why)")
    status.add_argument("job_id", nargs="?", help="one job (default: all)")
    status.add_argument("--redis-url", default=redis_url, help="the stack's Redis (env JETROLL_REDIS_URL)")
    status.add_argument("--json", action="store_true", help="print JSON: the job's record, or job_id -> record")

    dlq = sub.add_parser("dlq", help="a job's dead letters: counts by stream and kind of reason, and the newest")
    dlq.add_argument("job_id")
    dlq.add_argument("--redis-url", default=redis_url, help="the job's Redis (env JETROLL_REDIS_URL)")
    dlq.add_argument("--list", type=int, default=10, metavar="N", help="also print the newest N records (default 10)")
    dlq.add_argument("--json", action="store_true", help="print JSON: counts and the newest records")


def _add_service_parsers(sub: Any, redis_url: str | None) -> None:
    """`jetroll controller|rollout|reward|trainer|env`: one job's service (--config), or watch mode (--watch)."""
    for name in SERVICES:
        svc = sub.add_parser(name, help=f"run the {name} service (the launcher starts these; --watch: event-triggered "
                             "jobs)")
        source = svc.add_mutually_exclusive_group(required=True)
        source.add_argument("--config", type=Path, help="resolved job config JSON from the launcher")
        source.add_argument("--watch", action="store_true", help="serve the jobs that `jetroll submit` queues, one "
                            "after another" + (" (runs each)" if name == "controller" else " (joins each while it "
                                               "runs)"))
        svc.add_argument("--redis-url", default=redis_url, help="env JETROLL_REDIS_URL")
        svc.add_argument("--consumer", help="consumer name in the stream's consumer group (default: the service "
                         "name; --watch: " + ("controller" if name == "controller" else f"{name}-<hostname>-<pid>")
                         + ")")
        svc.add_argument("--run-dir", type=Path, help="with --config: the job's run dir")
        svc.add_argument("--runs-dir", type=Path, default=Path("runs"), help="--watch: each job's run dir is "
                         "RUNS_DIR/<job_id> (default runs)")
        svc.add_argument("--heartbeat-file", type=Path, default=os.environ.get("JETROLL_HEARTBEAT_FILE"),
                         help="touch this file every few seconds (container healthchecks; env JETROLL_HEARTBEAT_FILE)")
        if name in ("rollout", "env"):
            svc.add_argument("--pool", help="the rollout pool to serve (default: the first in rollout.pools)")


def use_inductor_cache_of_this_cpu() -> None:
    """A process with ATEN_CPU_CAPABILITY set gets inductor's on-disk cache of that capability (unless
    TORCHINDUCTOR_CACHE_DIR is set): the cache key misses the capability, so an AVX2 process reused the compiled
    decode kernels of an AVX512 one and sampled garbage (a reward of 0.5% where the uncompiled decode got 45%)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability:
        default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default / capability.lower()))


def main(argv: list[str] | None = None) -> int:
    use_inductor_cache_of_this_cpu()  # before anything imports torch
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("botocore").setLevel(logging.WARNING)  # "Found credentials in ..." on every client
    if args.command in ("run", "bench"):
        signal.signal(signal.SIGTERM, _interrupt)
        # a shell starts `cmd &` with SIGINT ignored, and Python keeps that: make `kill -INT` stop the job anyway
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "init-model":
            from jetroll.functions.scoring import job_tasks
            from jetroll.shared.warm_start import main as init_main

            config = load_config(args.config, args.overrides)
            init_main(config.model, job_tasks(config), force=args.force)
            return 0
        if args.command == "bench":
            return run_bench(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "config":
            return _config_reference(parser, args)
        if args.command == "submit":
            return _submit(parser, args)
        if args.command == "status":
            return _status(parser, args)
        if args.command == "dlq":
            from jetroll.services.launch.jobs import print_dead_letters

            return print_dead_letters(args.job_id, args.redis_url, args.list, as_json=args.json)
        if args.command == "celery-worker":
            return _celery_worker(parser, args)
        return _serve(parser, args)
    except ConfigError as exc:
        print(f"jetroll: {exc}", file=sys.stderr)
        return 2
    except WarmStartError as exc:
        print(f"jetroll: {exc}", file=sys.stderr)
        return 1
    except JobFailedError as exc:
        print(f"jetroll: job failed: {exc}", file=sys.stderr)
        return JOB_FAILED_EXIT
    except KeyboardInterrupt:
        print(f"jetroll: {args.command} interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `jetroll config | head`: the reader left; say nothing and skip the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _run(args: argparse.Namespace) -> int:
    from jetroll.services.launch.jobs import load_job_config
    from jetroll.services.launch.local import Launcher
    from jetroll.services.launch.run import run

    config = load_job_config(args.config, args.overrides)
    if args.max_steps is not None:
        config = validate_config({**config.model_dump(), "trainer": {
            **config.trainer.model_dump(), "max_steps": args.max_steps}})
    if args.launcher == "ray":
        from jetroll.services.launch.ray import run_ray_job

        return run_ray_job(config, run_dir=args.run_dir, redis_url=args.redis_url, ray_address=args.ray_address,
                           num_cpus=args.ray_num_cpus)
    return run(config, lambda resolved, run_dir, redis_url, server: Launcher(resolved, run_dir, redis_url,
                                                                             redis_server=server),
               run_dir=args.run_dir, redis_url=args.redis_url)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops `run` and `bench` as Ctrl-C does: their finally blocks stop the services and Redis they started
    (the default action would leave them running, orphaned). A second SIGTERM must not cut that clean-up short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _submit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from jetroll.services.launch import jobs
    from jetroll.shared.protocol.topology import JOBS

    if args.to == "redis" and not args.redis_url:
        parser.error("submit --to redis needs --redis-url (or JETROLL_REDIS_URL)")
    if args.to == "s3" and not args.jobs_uri:
        parser.error("submit --to s3 needs --jobs-uri s3://bucket/jobs/ (or JETROLL_JOBS_URI)")
    config = load_config(args.config, args.overrides)
    jobs.check_job_id(config.job_id)
    try:
        if args.to == "redis":
            asyncio.run(jobs.submit_to_redis(config, args.redis_url))
            where = f"queued on {JOBS.name}"
        else:
            where = f"put at {jobs.submit_to_s3(config, args.jobs_uri, args.endpoint_url)}"
    except Exception as exc:  # one line, not a traceback: the server is down, the bucket missing, no credentials
        print(f"jetroll: cannot submit job {config.job_id}: {type(exc).__name__}: {exc}".splitlines()[0],
              file=sys.stderr)
        return 1
    print(f"jetroll: job {config.job_id} {where}", file=sys.stderr)
    print(config.job_id)
    return 0


def _config_reference(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from jetroll.shared.config.reference import field_docs, format_reference

    docs = field_docs()
    if args.section:
        docs = [doc for doc in docs if f"{doc.path}.".startswith(f"{args.section}.")
                or doc.path.startswith(f"{args.section}[]")]
        if not docs:
            sections = sorted({doc.path.split(".")[0].removesuffix("[]") for doc in field_docs()})
            parser.error(f"no config field under {args.section!r}; sections: {', '.join(sections)}")
    print(json.dumps([asdict(doc) for doc in docs], indent=1) if args.json else format_reference(docs))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from jetroll.functions.runner import REWARDS
    from jetroll.shared.evaluate import score_run

    versions = None if args.versions is None else list(comma_ints(args.versions, "--versions"))
    rows = asyncio.run(score_run(args.run_dir, REWARDS, versions, args.num_problems, args.split))
    if args.json:
        print(json.dumps({"run_dir": str(args.run_dir), "rows": rows}))
        return 0
    for row in rows:
        # the standard error of a fraction of n independent problems: how finely n problems resolve the accuracy
        scores = ", ".join(f"{name} {row[name]:.2%} +- {math.sqrt(row[name] * (1 - row[name]) / max(n, 1)):.2%} of {n}"
                           for name, n in row["num_problems"].items())
        print(f"v{row['version']}: {scores}")
    return 0


def _status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from jetroll.services.launch.jobs import format_status
    from jetroll.shared.protocol.jobs import JobQueue

    if not args.redis_url:
        parser.error("status needs --redis-url (or JETROLL_REDIS_URL)")

    async def read() -> dict[str, dict]:
        async with JobQueue(args.redis_url) as queue:
            return await queue.board.all()

    records = asyncio.run(read())
    if args.job_id is not None:
        if args.job_id not in records:
            print(f"jetroll: no job {args.job_id!r}", file=sys.stderr)
            return 1
        records = {args.job_id: records[args.job_id]}
    if args.json:
        print(json.dumps(records[args.job_id] if args.job_id else records, indent=2))
    else:
        print(format_status(records))
    return 0


def _celery_worker(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Replace this process with the Celery worker the local launcher would start for the job's reward config."""
    from jetroll.services.launch.celery_worker import worker_command, worker_env

    reward = load_config(args.config, args.overrides).reward
    broker_url = reward.celery_broker_url or args.redis_url
    if not broker_url:
        parser.error("celery-worker needs --redis-url (or JETROLL_REDIS_URL, or reward.celery_broker_url)")
    cmd = worker_command(reward, node=args.node or f"jetroll@{socket.gethostname()}")
    os.execvpe(cmd[0], cmd, {**os.environ, **worker_env(reward, broker_url)})


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.redis_url:
        parser.error(f"{args.command} needs --redis-url (or JETROLL_REDIS_URL)")
    if args.watch:
        if args.run_dir is not None:
            parser.error("--run-dir goes with --config; with --watch each job runs in --runs-dir/<job_id>")
        main = watch_main(args.command, args.redis_url, args.runs_dir, args.consumer, getattr(args, "pool", None))
    else:
        if args.run_dir is None:
            parser.error("--config needs --run-dir")
        config = validate_config(json.loads(args.config.read_text()))
        prepare_process(args.command, config)
        main = service_main(args.command, config, args.redis_url, args.consumer or args.command, args.run_dir,
                             getattr(args, "pool", None))
    try:
        asyncio.run(until_sigterm(main, args.heartbeat_file))
    except asyncio.CancelledError:
        return 143
    return 0


if __name__ == "__main__":
    sys.exit(main())
