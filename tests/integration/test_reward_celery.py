"""The Celery backend against a real prefork worker on a real Redis: redelivery after a pool child or the whole
worker dies is scored exactly once, and time limits and failures end as statuses, never as reward 0."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from helpers import wait_until_async
from reward_harness import (
    PYTHONPATH,
    REWARD_MODULES,
    by_traj_id,
    reward_tasks,
    running_router,
    started,
    traj,
    wait_scored,
)

from jetroll.functions.celery_app import MAX_RUNS
from jetroll.services.launch.celery_worker import CeleryWorker
from jetroll.services.launch.redis_server import RedisServer
from jetroll.services.reward.backends import setup_backend
from jetroll.shared.config.reward import RewardConfig
from jetroll.shared.protocol.call_records import BrokerUnreachable, CeleryReplies
from jetroll.shared.protocol.topology import TRAJ_RAW

pytestmark = pytest.mark.integration

# Time-limit tests: soft 2 s, hard 3 s. Kill tests: limits above the worker's dead-child detection (its 5 s pool
# maintenance tick plus worker_lost_wait), so a killed child's task is requeued before a time limit reports it;
# a dead worker's task comes back after the 10 s visibility timeout.
SOFT_S, VISIBILITY_S = 2.0, 10.0
KILL_SOFT_S = 8.0


def celery_config(soft_s: float = SOFT_S) -> RewardConfig:
    """Short limits, and a queue of its own so no test sees another's redelivered tasks."""
    return RewardConfig(backend="celery", timeout_s=soft_s, celery_hard_grace_s=1.0,
                        celery_visibility_timeout_s=VISIBILITY_S, celery_concurrency=2,
                        celery_queue=f"test-{uuid.uuid4().hex[:8]}", modules=list(REWARD_MODULES))


@pytest.fixture
def start_worker(redis_url: str, tmp_path: Path) -> Iterator[Callable[[RewardConfig], CeleryWorker]]:
    """Start `celery -A jetroll.functions.celery_app worker --pool=prefork` processes; all stopped at teardown."""
    workers: list[CeleryWorker] = []
    env = {"PYTHONPATH": os.pathsep.join(p for p in (PYTHONPATH, os.environ.get("PYTHONPATH", "")) if p)}

    def start(config: RewardConfig) -> CeleryWorker:
        worker = CeleryWorker(config, redis_url, log_path=tmp_path / f"worker-{len(workers)}.log", env=env)
        workers.append(worker)
        return worker.start()

    yield start
    for worker in workers:
        worker.stop()


async def wait_for_pids(path: Path, count: int, timeout_s: float = 20.0) -> list[int]:
    """The pids `test_pid_sleep` wrote to `path`, once there are `count` of them."""
    async def pids() -> list[int] | None:
        found = [int(line) for line in path.read_text().split()] if path.exists() else []
        return found if len(found) >= count else None

    return await wait_until_async(pids, f"{count} runs to start", timeout_s, interval_s=0.02)


def test_pool_child_killed_mid_task_is_redelivered_and_scored_once(
    redis_url: str, start_worker: Callable[[RewardConfig], CeleryWorker], tmp_path: Path
) -> None:
    config = celery_config(KILL_SOFT_S)
    worker = start_worker(config)
    job, pid_file = uuid.uuid4().hex[:8], tmp_path / "pids"

    async def scenario() -> list:
        async with started(setup_backend("celery", config, redis_url=redis_url, job_id=job)) as celery, \
                running_router(redis_url, job, {"celery": celery}) as (bus, _):
            await bus.publish(TRAJ_RAW.name, traj(job, "k0:0", "t_pid_sleep", "1.5", str(pid_file)))
            (child,) = await wait_for_pids(pid_file, 1)
            assert child != worker.pid and os.getpgid(child) == worker.pid  # a pool child, not the worker
            os.kill(child, signal.SIGKILL)
            return await wait_scored(bus, 1, timeout_s=30)

    with reward_tasks(t_pid_sleep="test_pid_sleep"):
        scored = asyncio.run(scenario())
    event = by_traj_id(scored)["k0:0"]
    # one router attempt: Celery redelivered the task itself (reject_on_worker_lost), at once
    assert (event.status, event.reward, event.attempts, event.backend) == ("ok", 1.0, 1, "celery")
    first, second = [int(line) for line in pid_file.read_text().split()]
    assert first != second and os.getpgid(second) == worker.pid
    assert worker.process is not None and worker.process.poll() is None


def test_whole_worker_killed_is_redelivered_after_visibility_timeout_and_scored_once(
    redis_url: str, start_worker: Callable[[RewardConfig], CeleryWorker], tmp_path: Path
) -> None:
    config = celery_config(KILL_SOFT_S)
    doomed = start_worker(config)
    job, pid_file = uuid.uuid4().hex[:8], tmp_path / "pids"

    async def scenario() -> tuple[list, float, CeleryWorker]:
        async with started(setup_backend("celery", config, redis_url=redis_url, job_id=job)) as celery, \
                running_router(redis_url, job, {"celery": celery}) as (bus, _):
            await bus.publish(TRAJ_RAW.name, traj(job, "w0:0", "t_pid_sleep", "1.5", str(pid_file)))
            await wait_for_pids(pid_file, 1)
            killed_at = time.monotonic()
            doomed.kill(signal.SIGKILL)  # main process and pool children: nothing can ack or requeue
            assert doomed.process is not None and doomed.process.wait(timeout=10) == -signal.SIGKILL
            survivor = await asyncio.to_thread(start_worker, config)
            scored = await wait_scored(bus, 1, timeout_s=40)
            return scored, time.monotonic() - killed_at, survivor

    with reward_tasks(t_pid_sleep="test_pid_sleep"):
        scored, elapsed_s, survivor = asyncio.run(scenario())
    event = by_traj_id(scored)["w0:0"]
    assert (event.status, event.reward, event.attempts) == ("ok", 1.0, 1)
    first, second = [int(line) for line in pid_file.read_text().split()]
    assert first != second and os.getpgid(second) == survivor.pid
    assert elapsed_s >= VISIBILITY_S - 2.0  # not before the visibility timeout (counted from delivery)


def test_time_limits_are_timeouts_never_reward_zero(
    redis_url: str, start_worker: Callable[[RewardConfig], CeleryWorker]
) -> None:
    config = celery_config()
    worker = start_worker(config)
    job = uuid.uuid4().hex[:8]

    async def scenario() -> list:
        async with started(setup_backend("celery", config, redis_url=redis_url, job_id=job)) as celery, \
                running_router(redis_url, job, {"celery": celery}, max_retries=1) as (bus, _):
            await bus.publish(TRAJ_RAW.name, traj(job, "t0:0", "t_sleep", "30", ""))  # stopped by the soft limit
            await bus.publish(TRAJ_RAW.name, traj(job, "t1:0", "t_stubborn", "30", ""))  # only the hard limit works
            return await wait_scored(bus, 2, timeout_s=40)

    with reward_tasks(t_sleep="test_sleep", t_stubborn="test_stubborn"):
        scored = asyncio.run(scenario())
    events = by_traj_id(scored)
    for traj_id, limit in (("t0:0", "soft time limit"), ("t1:0", "hard time limit")):
        event = events[traj_id]
        assert (event.status, event.reward, event.attempts) == ("timeout", None, 2), event  # retried once
        assert limit in event.details["error"]
    assert worker.process is not None and worker.process.poll() is None


def test_failures_are_errors_and_a_call_delivered_too_often_is_not_run_again(
    redis_url: str, start_worker: Callable[[RewardConfig], CeleryWorker]
) -> None:
    config = celery_config()
    start_worker(config)
    job = uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(redis_url)
    for attempt in (1, 2):  # as if a worker-killing reward had already taken down MAX_RUNS pool children
        client.set(f"jetroll:{job}:reward:celery:e1:0:{attempt}:runs", MAX_RUNS)
    client.close()

    async def scenario() -> list:
        async with started(setup_backend("celery", config, redis_url=redis_url, job_id=job)) as celery, \
                running_router(redis_url, job, {"celery": celery}, max_retries=1) as (bus, _):
            await bus.publish(TRAJ_RAW.name, traj(job, "e0:0", "t_raise", "x", ""))
            await bus.publish(TRAJ_RAW.name, traj(job, "e1:0", "t_exit", "x", ""))
            await bus.publish(TRAJ_RAW.name, traj(job, "e2:0", "arithmetic", "12", "12"))
            await bus.publish(TRAJ_RAW.name, traj(job, "e3:0", "arithmetic", "7", "7", env_status="tool_crashed"))
            return await wait_scored(bus, 4, timeout_s=60)

    with reward_tasks(t_raise="test_raise", t_exit="test_exit"):
        scored = asyncio.run(scenario())
    events = by_traj_id(scored)
    raised, exhausted, fine, env_failed = (events[f"e{i}:0"] for i in range(4))
    assert (raised.status, raised.reward, raised.attempts) == ("error", None, 2)
    assert "RuntimeError: boom" in raised.details["error"]
    assert (exhausted.status, exhausted.reward, exhausted.attempts) == ("error", None, 2)
    assert f"died in each of {MAX_RUNS} runs" in exhausted.details["error"]
    assert (fine.status, fine.reward) == ("ok", 1.0)
    assert (env_failed.status, env_failed.reward, env_failed.attempts) == ("env_fail", None, 0)


def test_a_reply_wait_sees_a_broker_restart_instead_of_waiting_out_the_visibility_timeout(tmp_path: Path) -> None:
    """The broker SIGKILLed under a call's BLPOP and back on its port at once, well inside the clients' usual
    reconnect window. The wait raises BrokerUnreachable (so the call sends its task again) rather than resume on the
    restarted broker: its task may be lost with the outage, or held unacked by a worker that died of it, and no reply
    would come before the visibility timeout. Beside the Ray launcher the job-level outage test hit this."""
    broker = RedisServer(data_dir=tmp_path / "broker").start()
    replies = CeleryReplies(broker.url, "t", wait_s=60.0)

    async def scenario() -> None:
        assert await replies.kept(replies.key("g0:0", 1)) is None  # connected
        waiting = asyncio.create_task(replies.wait(replies.key("g0:0", 1)))
        await asyncio.sleep(0.3)
        assert broker._proc is not None
        os.kill(broker._proc.pid, signal.SIGKILL)
        broker._proc.wait()
        broker.restart()
        with pytest.raises(BrokerUnreachable):
            await asyncio.wait_for(waiting, timeout=20.0)
        await replies.close()

    try:
        asyncio.run(scenario())
    finally:
        broker.stop()
