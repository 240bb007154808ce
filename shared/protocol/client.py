"""Redis clients for every part of jetroll, built in one place with one retry policy, and reply helpers."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

# a command that loses its connection is retried for about 17 s (0.05 s doubling to 1 s, 20 times): long enough
# for a restarted Redis to come back on its port; a re-sent write may apply twice, which every consumer dedups
RECONNECT_RETRIES, RECONNECT_BASE_S, RECONNECT_CAP_S = 20, 0.05, 1.0


class RedisUnreachable(Exception):
    """No Redis server answered at a URL."""


def connect(url: str, *, socket_timeout_s: float | None = None, retries: int = RECONNECT_RETRIES) -> aioredis.Redis:
    """An asyncio client of jetroll's Redis (or a Celery broker's); RESP2 pinned, so reply shapes are the same on
    every server version. `socket_timeout_s`: for a client that blocks server-side longer than redis-py's default;
    `retries` 0 for one that must see a lost connection rather than carry on across a restart."""
    retry = AsyncRetry(ExponentialBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S), retries)
    return aioredis.Redis.from_url(url, protocol=2, retry=retry, socket_timeout=socket_timeout_s)


def connect_sync(url: str, *, connect_timeout_s: float | None = None, timeout_s: float | None = None,
                 retries: int = RECONNECT_RETRIES) -> redis.Redis:
    """The same, synchronous (Celery tasks, probes): `retries` 0 for a probe that must answer at once."""
    retry = Retry(ExponentialBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S), retries)
    return redis.Redis.from_url(url, protocol=2, retry=retry, socket_connect_timeout=connect_timeout_s,
                                socket_timeout=timeout_s)


def server_version(url: str, *, connect_timeout_s: float = 3.0, timeout_s: float = 3.0) -> str:
    """PING the server at `url` and return its version; RedisUnreachable when it does not answer."""
    client = connect_sync(url, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s, retries=0)
    try:
        client.ping()
        return str(client.info("server")["redis_version"])
    except redis.RedisError as exc:
        raise RedisUnreachable(f"cannot reach Redis at {url}: {exc}") from exc
    finally:
        client.close()


def as_str(value: bytes | str) -> str:
    """A reply field as text (RESP2 replies are bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def stream_entries(response: Any) -> list[tuple[Any, Any]]:
    """Entries of the single stream in an XREAD/XREADGROUP reply (RESP2 list or RESP3 dict shape)."""
    if not response:
        return []
    if isinstance(response, dict):
        return next(iter(response.values()))
    return response[0][1]
