"""The job's own redis-server: persistence under a data dir, a restart on the same port, clients that wait for it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import aof_path

from jetroll.services.launch.redis_server import RedisServer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.client import connect
from jetroll.shared.protocol.events import MetricsEvent

pytestmark = pytest.mark.integration


def test_a_killed_server_restarts_on_its_port_with_every_write_its_file_holds(redis_binary: str,
                                                                              tmp_path: Path) -> None:
    server = RedisServer(redis_binary, data_dir=tmp_path / "redis").start()
    try:
        url = server.url

        async def scenario() -> tuple[bytes | None, int, float]:
            client = connect(server.url)
            try:
                await client.set("before", "kept")
                await client.xadd("stream", {"e": b"1"})
                # everysec: while a background fsync is slow Redis acks and holds the write back for up to 2 s
                # (a busy disk in CI lost this XADD); a kill loses what the file does not hold yet
                deadline = time.monotonic() + 5
                while b"stream" not in aof_path(tmp_path / "redis").read_bytes() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert server._proc is not None
                os.kill(server._proc.pid, signal.SIGKILL)
                while server.is_running:
                    await asyncio.sleep(0.01)
                assert server.returncode == -signal.SIGKILL
                # the restart comes a second later, from another thread: the client's command waits for it
                restarter = threading.Timer(1.0, server.restart)
                restarter.start()
                started = time.monotonic()
                value = await client.get("before")
                waited = time.monotonic() - started
                restarter.join()
                return value, await client.xlen("stream"), waited
            finally:
                await client.aclose()

        value, length, waited = asyncio.run(scenario())
        assert (value, length) == (b"kept", 1)
        assert waited >= 0.9  # it really ran across the outage
        assert server.url == url and server.is_running
    finally:
        server.stop()
    assert (tmp_path / "redis").is_dir()  # stop keeps a data dir


def test_without_a_data_dir_nothing_persists(tmp_path: Path) -> None:
    with RedisServer() as server:
        assert server._tmp is not None
        where = Path(server._tmp.name)
        assert where.is_dir()
    assert not where.exists()


def test_backpressure_survives_a_restart_that_rewinds_a_groups_entries_read(redis_binary: str,
                                                                             tmp_path: Path) -> None:
    """Redis 7.0 reloads a group's entries-read from its last AOF rewrite, so after a restart XINFO's `lag` counts
    every entry read since that rewrite as unread, forever (the chaos bench's job stalled on it at step 2297): the
    bus's lag, and the producers' backpressure on it, still count only what the group has not finished."""
    server = RedisServer(redis_binary, data_dir=tmp_path / "redis").start()
    try:
        async def cycle(bus: RedisBus, n: int) -> None:
            await bus.publish_many("traj:raw", [MetricsEvent(job_id=bus.job_id, service="t", values={"x": 1.0},
                                                             step=i, time=0.0) for i in range(n)])
            got = await bus.consume("traj:raw", "reward", "c", count=n, block_ms=100)
            await bus.ack("traj:raw", "reward", *(d.entry_id for d in got))

        async def scenario() -> tuple[int, int]:
            bus = RedisBus(server.url, "rewind")
            try:
                await bus.ensure_group("traj:raw", "reward")
                await cycle(bus, 50)
                await bus.redis.bgrewriteaof()
                while (info := await bus.redis.info("persistence"))["aof_rewrite_in_progress"] or \
                        info["aof_rewrite_scheduled"]:
                    await asyncio.sleep(0.05)
                for _ in range(6):
                    await cycle(bus, 50)
                await asyncio.sleep(1.5)  # past appendfsync everysec: every write above is on disk
                assert server._proc is not None
                os.kill(server._proc.pid, signal.SIGKILL)
                while server.is_running:
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(server.restart)
                reported = next(g.get("lag") for g in await bus.redis.xinfo_groups(bus.key("traj:raw")))
                lag = await bus.lag("traj:raw", "reward")
                await asyncio.wait_for(bus.wait_for_capacity("traj:raw", "reward", max_lag=100), timeout=5)
                return lag, -1 if reported is None else int(reported)
            finally:
                await bus.close()

        lag, reported = asyncio.run(scenario())
        assert lag == 0
        if (server.version or "").startswith("7.0"):  # the rewind itself (6.2 gives no lag at all)
            assert reported == 300, reported
    finally:
        server.stop()
