"""The job's own redis-server: persistence under a data dir, a restart on the same port, clients that wait for it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from jetroll.services.launch.redis_server import RedisServer
from jetroll.shared.protocol.bus import connect

pytestmark = pytest.mark.integration


def test_a_killed_server_restarts_on_its_port_with_every_acknowledged_write(redis_binary: str, tmp_path: Path) -> None:
    server = RedisServer(redis_binary, data_dir=tmp_path / "redis").start()
    try:
        url = server.url

        async def scenario() -> tuple[bytes | None, int, float]:
            client = connect(server.url)
            try:
                await client.set("before", "kept")
                await client.xadd("stream", {"e": b"1"})
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
