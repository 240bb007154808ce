"""The job queue of watch mode, in Redis under global keys (topology.py):

- `jetroll:jobs`: stream of submitted JobEvents (validated, unresolved configs), read in the controller's group;
- `jetroll:jobs:active`: stream of JobEvents with the resolved config, one per job the controller starts;
  watch-mode services tail it and join a job while its status is `running`;
- `jetroll:jobs:status`: hash job_id -> JSON {status: queued|running|done|failed, submitted_at, started_at,
  finished_at, run_dir, the summary's fields when done, error when failed};
- `jetroll:jobs:dlq`: unprocessable submissions, with the reason.

Entries come back raw, (entry_id, payload or None): what a bad submission is, and what happens to it, is the
watcher's to say.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError, WatchError

from jetroll.shared.protocol.bus import FIELD
from jetroll.shared.protocol.client import as_str, connect, stream_entries
from jetroll.shared.protocol.events import JobEvent, encode
from jetroll.shared.protocol.topology import ACTIVE, JOBS, JOBS_DLQ, STATUS

MAX_ANNOUNCED = 1000  # approximate MAXLEN of the active stream: the recent jobs' resolved configs
RawEntry = tuple[str, bytes | None]


class JobBoard:
    """The status hash. Records are merged field by field; `expect` guards a transition (e.g. only a running job
    becomes done), so the first final status and its reason stand."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def get(self, job_id: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(STATUS, job_id)
        return json.loads(raw) if raw else None

    async def all(self) -> dict[str, dict[str, Any]]:
        return {k.decode(): json.loads(v) for k, v in (await self.redis.hgetall(STATUS)).items()}

    async def update(self, job_id: str, *, expect: Iterable[str | None] | None = None, **fields: Any) -> dict | None:
        """Merge `fields` into the job's record; None (and no change) when its status is not in `expect`."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(STATUS)
                    raw = await pipe.hget(STATUS, job_id)
                    record = json.loads(raw) if raw else {}
                    if expect is not None and record.get("status") not in tuple(expect):
                        return None
                    record.update(fields)
                    pipe.multi()
                    pipe.hset(STATUS, job_id, json.dumps(record))
                    await pipe.execute()
                    return record
                except WatchError:
                    continue


class JobQueue:
    """The queue, its announcements, its dead letters and its board, on one connection. `async with` closes it."""

    def __init__(self, redis_url: str) -> None:
        self.redis = connect(redis_url)
        self.board = JobBoard(self.redis)

    async def submit(self, event: JobEvent) -> None:
        """Queue the job with a fresh `queued` status record, in one transaction."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(STATUS, event.job_id, json.dumps({"status": "queued", "submitted_at": event.submitted_at}))
            pipe.xadd(JOBS.name, {FIELD: encode(event)})
            await pipe.execute()

    async def join(self) -> None:
        """Create the controllers' consumer group at the start of the queue unless it exists."""
        try:
            await self.redis.xgroup_create(JOBS.name, JOBS.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, consumer: str, *, pending: bool, block_ms: int) -> list[RawEntry]:
        """This consumer's unacked submissions (`pending`: a restarted watcher's), else the next new one."""
        reply = await self.redis.xreadgroup(JOBS.group, consumer, {JOBS.name: "0" if pending else ">"}, count=1,
                                            block=None if pending else block_ms)
        return [(as_str(raw_id), (fields or {}).get(FIELD)) for raw_id, fields in stream_entries(reply)]

    async def ack(self, entry_id: str) -> None:
        await self.redis.xack(JOBS.name, JOBS.group, entry_id)

    async def dead_letter(self, entry_id: str, payload: bytes | None, reason: str) -> None:
        record: dict[str, str | bytes] = {"stream": JOBS.name, "entry_id": entry_id, "reason": reason}
        if payload is not None:
            record["payload"] = payload
        await self.redis.xadd(JOBS_DLQ, record)

    async def announce(self, event: JobEvent) -> None:
        """Tell watching services that a job started, with its resolved config."""
        await self.redis.xadd(ACTIVE, {FIELD: encode(event)}, maxlen=MAX_ANNOUNCED, approximate=True)

    async def announcements(self, last_id: str, *, block_ms: int) -> list[RawEntry]:
        """Announcements after `last_id` ("0-0": from the oldest kept)."""
        reply = await self.redis.xread({ACTIVE: last_id}, count=16, block=block_ms)
        return [(as_str(raw_id), (fields or {}).get(FIELD)) for raw_id, fields in stream_entries(reply)]

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> JobQueue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
