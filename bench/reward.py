"""Reward backends head to head: rewards/s and p50/p99 latency of one trivial reward through local, celery and lambda.

Every backend gets the same `workers` executors (local pool processes, prefork children, Lambda environments on the
local Invoke endpoint) and the same in-flight limit; the bench keeps 1, 8 or 32 calls outstanding. A call's latency
is the backend's `score()` as the router sees it, so `summary.overhead_ms` (p50 at concurrency 1 minus local's) is
the per-call price of the transport: broker round trips for celery, HTTP + JSON + the idempotency record for lambda.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import time
import uuid
from contextlib import AsyncExitStack, ExitStack
from typing import Any

from jetroll.services.launch.redis_server import RedisServer
from jetroll.services.reward.backends import BACKENDS, setup_backend
from jetroll.services.reward.backends.base import RewardBackend, RewardCall
from jetroll.shared.config.reward import RewardConfig
from jetroll.shared.errors import ConfigError

REWARD, COMPLETION, ANSWER = "arithmetic", "579", "579"
LOOPBACK = ("http://127.0.0.1", "http://localhost")
LOCAL_AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}  # what a local endpoint ignores


async def _measure(backend: RewardBackend, concurrency: int, num_calls: int, tag: str) -> dict[str, Any]:
    """`num_calls` calls with `concurrency` outstanding; unique traj_ids, so no idempotency record is reused."""
    latencies_s: list[float] = []
    num_not_ok = 0
    next_call = iter(range(num_calls))

    async def client() -> None:
        nonlocal num_not_ok
        for i in next_call:
            start = time.perf_counter()
            outcome = await backend.score(RewardCall(f"{tag}:{i}", 1, REWARD, COMPLETION, ANSWER))
            latencies_s.append(time.perf_counter() - start)
            num_not_ok += outcome.status != "ok"

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall_s = time.perf_counter() - start
    latencies_ms = sorted(s * 1000 for s in latencies_s)
    return {
        "backend": backend.name,
        "concurrency": concurrency,
        "calls": num_calls,
        "rewards_per_s": num_calls / wall_s,
        "p50_ms": statistics.median(latencies_ms),
        "p99_ms": latencies_ms[min(len(latencies_ms) - 1, int(0.99 * len(latencies_ms)))],
        "mean_ms": statistics.fmean(latencies_ms),
        "not_ok": num_not_ok,
    }


async def _run(config: RewardConfig, redis_url: str, backends: tuple[str, ...], concurrency: tuple[int, ...],
               num_calls: int) -> list[dict[str, Any]]:
    rows = []
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        for name in backends:
            backend = await stack.enter_async_context(
                setup_backend(name, config, redis_url=redis_url, job_id=job_id))
            # warm-up: start every executor (pool processes, prefork children, Lambda cold starts)
            await _measure(backend, backend.concurrency, 4 * backend.concurrency, f"{name}-warmup")
            for level in concurrency:
                rows.append(await _measure(backend, level, num_calls, f"{name}-c{level}"))
    return rows


def run_reward_bench(
    concurrency: tuple[int, ...] = (1, 8, 32),
    num_calls: int = 400,
    workers: int = 4,
    backends: tuple[str, ...] | None = None,
    lambda_endpoint: str | None = None,
) -> dict[str, Any]:
    """Start Redis and a Celery worker as needed, measure, stop them. The lambda backend runs against
    `lambda_endpoint`, any Lambda Invoke API (AWS's, or the fake a source checkout serves with
    `python tests/fakes/lambda_invoke.py`); by default it is measured when an endpoint is given."""
    if backends is None:
        backends = BACKENDS if lambda_endpoint else tuple(b for b in BACKENDS if b != "lambda")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ConfigError(f"unknown reward backends {unknown}; valid: {', '.join(BACKENDS)}")
    if "lambda" in backends and not lambda_endpoint:
        raise ConfigError("bench reward: the lambda backend needs --lambda-endpoint URL (a Lambda Invoke API; from a "
                          "source checkout, `python tests/fakes/lambda_invoke.py --port 9001` serves one)")
    config = RewardConfig(num_workers=workers, celery_concurrency=workers, lambda_concurrency=workers,
                          celery_queue=f"bench-{uuid.uuid4().hex[:8]}", lambda_endpoint_url=lambda_endpoint)
    if lambda_endpoint and lambda_endpoint.startswith(LOOPBACK):
        for name, value in LOCAL_AWS.items():  # signing needs credentials; a local endpoint checks none
            os.environ.setdefault(name, value)
    with ExitStack() as stack:
        redis_server = stack.enter_context(RedisServer())
        if "celery" in backends:
            from jetroll.services.launch.celery_worker import CeleryWorker

            stack.enter_context(CeleryWorker(config, redis_server.url))
        rows = asyncio.run(_run(config, redis_server.url, backends, concurrency, num_calls))
    p50_c1 = {row["backend"]: row["p50_ms"] for row in rows if row["concurrency"] == min(concurrency)}
    top = max(concurrency)
    return {
        "config": {
            "reward": f"{REWARD} ({COMPLETION!r} vs {ANSWER!r})",
            "workers": workers,
            "calls_per_level": num_calls,
            "concurrency": list(concurrency),
            "executors": "local: pool processes; celery: prefork children; lambda: the endpoint's execution "
                         "environments; each backend's in-flight limit = workers",
            "lambda_endpoint": lambda_endpoint,
            "latency": "RewardBackend.score() as the router calls it; warm executors",
            "cpu": platform.processor() or platform.machine(),
            "num_cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "rows": rows,
        "summary": {
            "overhead_ms": {name: p50_c1[name] - p50_c1["local"] for name in p50_c1
                            if name != "local" and "local" in p50_c1},
            "overhead_basis": f"p50 latency at concurrency {min(concurrency)} minus local's",
            f"rewards_per_s_c{top}": {row["backend"]: row["rewards_per_s"] for row in rows
                                      if row["concurrency"] == top},
        },
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    table = Table(title=f"reward backends, {config['workers']} executors each, {config['calls_per_level']} calls "
                        "per level")
    for column in ("backend", "concurrency", "rewards/s", "p50 ms", "p99 ms", "not ok"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(row["backend"], str(row["concurrency"]), f"{row['rewards_per_s']:.0f}",
                      f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}", str(row["not_ok"]))
    console = Console()
    console.print(table)
    overhead = result["summary"]["overhead_ms"]
    console.print("overhead per call over local (p50): "
                  + ", ".join(f"{name} {ms:+.2f} ms" for name, ms in overhead.items()))
