"""Per-call records of the remote reward backends: what makes a reward call run at most once.

- Lambda: the router alone writes `{prefix}:{traj_id}`: "invoking" while its one invocation runs, then the outcome.
- Celery: the worker keeps the first outcome of a call under `{prefix}:{traj_id}:{attempt}` (SET NX) and pushes it to
  `{key}:reply`, where the router waits; `{key}:runs` counts the task's runs, so a call whose worker dies on every
  run ends instead of being redelivered forever.

Records live in the job's Redis (Lambda) or the Celery broker's, and expire after their `ttl_s`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
import redis.asyncio as aioredis

from jetroll.shared.protocol.client import connect, connect_sync

INVOKING = b"invoking"


class BrokerUnreachable(Exception):
    """The Celery broker's Redis did not answer (it is down or restarting)."""

# Keep the first outcome, then hand the kept one to the waiting router, atomically: a redelivery or a late
# hard-timeout report can never replace an outcome the router may already have read.
_KEEP_FIRST_AND_REPLY = """
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
local kept = redis.call('GET', KEYS[1])
redis.call('RPUSH', KEYS[2], kept)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return kept
"""


class LambdaRecords:
    def __init__(self, redis_url: str, prefix: str, ttl_s: int) -> None:
        self.prefix, self.ttl_s = prefix, ttl_s
        self.redis: aioredis.Redis = connect(redis_url)

    async def claim(self, traj_id: str) -> bytes | None:
        """Mark the call invoking; None when this is its first claim, else what the earlier one left: INVOKING
        (it never recorded an outcome) or the outcome's JSON."""
        key = f"{self.prefix}:{traj_id}"
        if await self.redis.set(key, INVOKING, nx=True, ex=self.ttl_s):
            return None
        return await self.redis.get(key) or INVOKING

    async def release(self, traj_id: str) -> None:
        """Forget a claim whose invocation did not run (throttled): the next one may invoke."""
        await self.redis.delete(f"{self.prefix}:{traj_id}")

    async def keep(self, traj_id: str, outcome: dict[str, Any]) -> None:
        await self.redis.set(f"{self.prefix}:{traj_id}", json.dumps(outcome), ex=self.ttl_s)

    async def close(self) -> None:
        await self.redis.aclose()


class CeleryReplies:
    """The router's side: find a kept outcome, or wait for the worker's reply."""

    def __init__(self, broker_url: str, prefix: str, wait_s: float) -> None:
        self.prefix, self.wait_s = prefix, wait_s
        # a socket timeout shorter than the BLPOP would cut it short and could drop a reply it already popped. No
        # retries: a BLPOP re-sent across a broker restart would wait out the visibility timeout for the reply of a
        # task the broker lost or a dead worker held; the call must see the outage, so it sends its task again
        self.redis: aioredis.Redis = connect(broker_url, socket_timeout_s=wait_s + 5.0, retries=0)

    def key(self, traj_id: str, attempt: int) -> str:
        return f"{self.prefix}:{traj_id}:{attempt}"

    async def kept(self, key: str) -> dict[str, Any] | None:
        try:
            kept = await self.redis.get(key)
        except redis.ConnectionError as exc:
            raise BrokerUnreachable(str(exc)) from exc
        return None if kept is None else json.loads(kept)

    async def wait(self, key: str) -> dict[str, Any] | None:
        """The outcome the worker pushed, or None after `wait_s`."""
        try:
            reply = await self.redis.blpop([f"{key}:reply"], timeout=self.wait_s)
            if reply is None:
                return None
            await self.redis.delete(f"{key}:reply")
        except redis.ConnectionError as exc:
            raise BrokerUnreachable(str(exc)) from exc
        return json.loads(reply[1])

    async def close(self) -> None:
        await self.redis.aclose()


class CeleryRecords:
    """The worker's side, synchronous as Celery tasks are; one client per process (prefork children must not share
    the parent's sockets)."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self._clients: dict[int, redis.Redis] = {}

    @property
    def redis(self) -> redis.Redis:
        pid = os.getpid()
        if pid not in self._clients:
            self._clients = {pid: connect_sync(self.broker_url)}
        return self._clients[pid]

    def kept(self, key: str) -> dict[str, Any] | None:
        kept = self.redis.get(key)
        return None if kept is None else json.loads(kept)

    def count_run(self, key: str, ttl_s: int) -> int:
        """Count one more run of the call's task; returns the runs so far."""
        runs_key = f"{key}:runs"
        num_runs = int(self.redis.incr(runs_key))
        self.redis.expire(runs_key, ttl_s)
        return num_runs

    def keep_first(self, key: str, outcome: dict[str, Any], ttl_s: int) -> dict[str, Any]:
        """Keep `outcome` unless the call has one, push the kept one to the router; returns the kept one."""
        return json.loads(self.redis.eval(_KEEP_FIRST_AND_REPLY, 2, key, f"{key}:reply", json.dumps(outcome), ttl_s))
