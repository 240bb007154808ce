"""The event bus on Redis Streams (6.2 and 7.x): consumer groups, reclaim, dead letters, lag backpressure.

Reading the dlq is `dead_letters.py`; dedupe on a hash is `claims.py`; the clients are `client.py`."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from jetroll.shared.config.launch import RedisConfig
from jetroll.shared.protocol.client import as_str, connect, stream_entries
from jetroll.shared.protocol.events import AnyEvent, Event, EventDecodeError, decode, encode
from jetroll.shared.protocol.topology import DLQ, DLQ_KEPT, job_key

FIELD = b"e"  # every entry holds one encoded event under this field
TRIM_EVERY_S = 1.0  # a consumer trims a stream past every group's acks on at most this often, after an ack
# a consumer's check of what a decoded event means (shared/protocol/validate.py): the reason it is unusable, or None
EventCheck = Callable[[AnyEvent], Awaitable[str | None]]


@dataclass(frozen=True, slots=True)
class Delivery:
    """One stream entry handed to a consumer; ack `entry_id` once its effect is durable."""

    entry_id: str
    event: AnyEvent
    times_delivered: int


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> str:
    ms, seq = _id_tuple(entry_id)
    return f"{ms}-{seq + 1}"


class RedisBus:
    """Streams namespaced as `jetroll:{job_id}:{name}`; every method takes the short name, e.g. "traj:raw"."""

    def __init__(self, url: str, job_id: str, *, max_deliveries: int = 5, claim_idle_ms: int = 15000,
                 trim_every_s: float | None = TRIM_EVERY_S) -> None:
        """`trim_every_s`: how often `ack` trims the stream past what every group has acked (None: never)."""
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        self.job_id = job_id
        self.max_deliveries = max_deliveries
        self.claim_idle_ms = claim_idle_ms
        self.trim_every_s = trim_every_s
        self._trimmed_at: dict[str, float] = {}  # stream -> monotonic time of its last trim by this bus
        self.redis = connect(url)

    @classmethod
    def of_job(cls, url: str, job_id: str, redis: RedisConfig) -> RedisBus:
        """A service's bus, with the job's delivery and claim settings."""
        return cls(url, job_id, max_deliveries=redis.max_deliveries, claim_idle_ms=redis.claim_idle_ms)

    def key(self, name: str) -> str:
        return job_key(self.job_id, name)

    async def publish(self, stream: str, event: Event, *, maxlen: int | None = None) -> str:
        """XADD one event, keeping only the newest `maxlen` entries when given; returns its entry id."""
        return as_str(await self.redis.xadd(self.key(stream), {FIELD: encode(event)}, maxlen=maxlen, approximate=False))

    async def publish_many(self, stream: str, events: list[Event]) -> list[str]:
        """XADD several events in one pipeline; returns their entry ids in order."""
        if not events:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for event in events:
                pipe.xadd(self.key(stream), {FIELD: encode(event)})
            return [as_str(entry_id) for entry_id in await pipe.execute()]

    async def publish_counted(self, events: dict[str, list[Event]], index: str, scores: dict[str, float],
                              counter: str, expected: int, count: int) -> None:
        """XADD the events (stream -> events), ZADD `scores` (member -> score) to the sorted set `index` and add
        `count` (at least their number) to `counter`, in one transaction, if `counter` still reads `expected`: a
        reader of the index never sees a member whose event was lost, a writer that dies leaves all of it or none,
        and a second writer of the counter is refused (RuntimeError)."""
        if count < sum(len(batch) for batch in events.values()):
            raise ValueError(f"count {count} is below the {sum(map(len, events.values()))} events")
        key = self.key(counter)
        moved = f"{key} moved past {expected}: another writer counts into it"
        while True:
            try:
                async with self.redis.pipeline(transaction=True) as pipe:
                    await pipe.watch(key)
                    if int(await pipe.get(key) or 0) != expected:
                        raise RuntimeError(moved)
                    pipe.multi()
                    pipe.incrby(key, count)
                    if scores:
                        pipe.zadd(self.key(index), scores)
                    for stream, batch in events.items():
                        for event in batch:
                            pipe.xadd(self.key(stream), {FIELD: encode(event)})
                    await pipe.execute()
                    return
            except aioredis.WatchError:
                # also raised when the connection drops while watching (a Redis restart): the counter, read on a
                # retrying connection, tells whether the transaction applied, did not, or met another writer
                # (whose seed-and-index draw would have published these very groups at the same count)
                now = int(await self.redis.get(key) or 0)
                if now == expected + count:
                    return
                if now != expected:
                    raise RuntimeError(moved) from None

    async def ensure_group(self, stream: str, group: str) -> None:
        """Create the consumer group at the start of the stream (creating the stream) unless it exists."""
        try:
            await self.redis.xgroup_create(self.key(stream), group, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def consume(
        self, stream: str, group: str, consumer: str, *, count: int = 16, block_ms: int = 1000,
        check: EventCheck | None = None,
    ) -> list[Delivery]:
        """Reclaim idle entries of dead consumers first, then read new ones; bad entries go to the dlq, acked: those
        that do not decode, and those `check` finds a reason against.

        `block_ms` <= 0 does not block (unlike Redis, where BLOCK 0 waits forever).
        """
        key = self.key(stream)
        deliveries, _ = await self._reclaim(stream, group, consumer, count, check, self.claim_idle_ms)
        if deliveries:
            return deliveries
        block = block_ms if block_ms > 0 else None
        reply = await self.redis.xreadgroup(group, consumer, {key: ">"}, count=count, block=block)
        out = []
        for raw_id, fields in stream_entries(reply):
            delivery = await self._accept(stream, group, as_str(raw_id), fields, times_delivered=1, check=check)
            if delivery is not None:
                out.append(delivery)
        return out

    async def take_over(self, stream: str, group: str, consumer: str, *,
                        check: EventCheck | None = None) -> list[Delivery]:
        """Claim every pending entry of `group` now, whoever holds it: the new life of a service that is the group's
        only consumer takes its predecessor's work over without waiting `claim_idle_ms`."""
        out, cursor = [], "0-0"
        while True:
            deliveries, cursor = await self._reclaim(stream, group, consumer, 256, check, 0, cursor)
            out += deliveries
            if cursor == "0-0":
                return out

    async def _reclaim(self, stream: str, group: str, consumer: str, count: int, check: EventCheck | None,
                       min_idle_ms: int, start: str = "0-0") -> tuple[list[Delivery], str]:
        """XAUTOCLAIM from `start`: the deliveries, and the cursor to continue from ("0-0" at the end)."""
        key = self.key(stream)
        reply = await self.redis.xautoclaim(key, group, consumer, min_idle_ms, start, count=count)
        cursor = as_str(reply[0])
        # 7.x drops deleted entries from the PEL and lists their ids apart; 6.2 returns them as nil.
        claimed = [(as_str(raw_id), fields) for raw_id, fields in reply[1] if raw_id is not None]
        if len(claimed) < len(reply[1]):
            await self._ack_deleted(stream, group, consumer)
        if not claimed:
            return [], cursor
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id, _ in claimed:
                pipe.xpending_range(key, group, min=entry_id, max=entry_id, count=1)
            pending = await pipe.execute()
        out = []
        for (entry_id, fields), info in zip(claimed, pending, strict=True):
            times = int(info[0]["times_delivered"]) if info else 1
            if times > self.max_deliveries:
                await self.dead_letter(stream, entry_id, fields.get(FIELD), "max deliveries exceeded")
                await self.ack(stream, group, entry_id)
                continue
            delivery = await self._accept(stream, group, entry_id, fields, times_delivered=times, check=check)
            if delivery is not None:
                out.append(delivery)
        return out, cursor

    async def _ack_deleted(self, stream: str, group: str, consumer: str) -> None:
        """Redis 6.2: ack this consumer's pending entries that no longer exist, so lag stops counting them."""
        key = self.key(stream)
        pending = await self.redis.xpending_range(key, group, min="-", max="+", count=1000, consumername=consumer)
        ids = [as_str(p["message_id"]) for p in pending]
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.xrange(key, min=entry_id, max=entry_id, count=1)
            found = await pipe.execute()
        gone = [entry_id for entry_id, entries in zip(ids, found, strict=True) if not entries]
        await self.ack(stream, group, *gone)

    async def _accept(
        self, stream: str, group: str | None, entry_id: str, fields: dict[bytes, bytes], *, times_delivered: int,
        check: EventCheck | None = None,
    ) -> Delivery | None:
        """Decode and check an entry; on failure dead-letter it (and ack it when read through a group) and return
        None."""
        payload = fields.get(FIELD)
        reason = None
        if payload is None:
            reason = f"missing field {FIELD.decode()!r}"
        else:
            try:
                event = decode(payload)
            except EventDecodeError as exc:
                reason = f"undecodable event: {exc}"
            else:
                if event.job_id != self.job_id:
                    reason = f"job_id {event.job_id!r} does not match the bus job_id {self.job_id!r}"
                elif check is not None and (problem := await check(event)) is not None:
                    reason = f"invalid {type(event).__name__}: {problem}"
        if reason is not None:
            await self.dead_letter(stream, entry_id, payload, reason)
            if group is not None:
                await self.ack(stream, group, entry_id)
            return None
        return Delivery(entry_id=entry_id, event=event, times_delivered=times_delivered)

    async def ack(self, stream: str, group: str, *entry_ids: str) -> None:
        """XACK, then, at most every `trim_every_s`, trim the stream past what every group has acked: its consumers
        keep a group-read stream bounded by the slowest group's unfinished entries."""
        if not entry_ids:
            return
        await self.redis.xack(self.key(stream), group, *entry_ids)
        if self.trim_every_s is None:
            return
        now = time.monotonic()
        if now - self._trimmed_at.get(stream, -self.trim_every_s) >= self.trim_every_s:
            self._trimmed_at[stream] = now  # before the await: concurrent acks do not trim twice
            await self.trim_acked(stream)

    async def keep_claimed(self, stream: str, group: str, consumer: str, entry_ids: list[str]) -> None:
        """Reset the idle time of entries still being worked on (XCLAIM JUSTID: no delivery is counted),
        so XAUTOCLAIM never hands a live consumer's work to someone else, or back to itself."""
        if entry_ids:
            await self.redis.xclaim(self.key(stream), group, consumer, 0, entry_ids, justid=True)

    async def lag(self, stream: str, group: str, *, scan_limit: int = 10_000) -> int:
        """Entries the group has not finished: never delivered plus delivered-but-unacked (pending).

        Where the server gives no `lag` (6.2, or 7.x after deletions), or one the stream cannot hold, the undelivered
        part is counted with XRANGE and capped at `scan_limit`; a group that has read the newest entry has none. Redis
        7.0 reloads a group's entries-read from its last AOF rewrite, not from the reads after it, so after a restart
        its `lag` counts those reads again, forever: a producer waiting on it alone would wait for good.
        """
        key = self.key(stream)
        info = await self._group_info(stream, group)
        pending = int(info["pending"])
        unread = info.get("lag")
        last_delivered = as_str(info["last-delivered-id"])
        if unread is not None and int(unread) > 0:  # check it: cheap where it is right, exact where it is not
            newest = await self.redis.xrevrange(key, count=1)
            if not newest or _id_tuple(as_str(newest[0][0])) <= _id_tuple(last_delivered):
                unread = 0  # the group has read every entry there is
            elif int(unread) > await self.redis.xlen(key):
                unread = None
        if unread is None:
            if last_delivered == "0-0":
                unread = await self.redis.xlen(key)  # nothing delivered yet: every entry is unread
            else:
                entries = await self.redis.xrange(key, min=f"({last_delivered}", max="+", count=scan_limit)
                unread = len(entries)
        return int(unread) + pending

    async def _group_info(self, stream: str, group: str) -> dict[str, Any]:
        for info in await self.redis.xinfo_groups(self.key(stream)):
            if as_str(info["name"]) == group:
                return info
        raise ValueError(f"no consumer group {group!r} on stream {self.key(stream)!r}")

    async def wait_for_capacity(self, stream: str, group: str, max_lag: int, poll_s: float = 0.05) -> None:
        """Backpressure: return once the group's lag is below `max_lag`; at once while the group does not exist yet
        (its consumer has not started, e.g. a watch-mode service still joining: it reads the stream from the start)."""
        while True:
            try:
                if await self.lag(stream, group, scan_limit=max_lag) < max_lag:
                    return
            except ValueError:  # no such group
                return
            except aioredis.ResponseError as exc:
                if "no such key" not in str(exc).lower():
                    raise
                return
            await asyncio.sleep(poll_s)

    async def tail(
        self, stream: str, last_id: str = "0-0", *, block_ms: int = 1000, count: int = 100,
        check: EventCheck | None = None,
    ) -> tuple[str, list[AnyEvent]]:
        """XREAD after `last_id` (no group); returns the new last id and the decoded events that pass `check` (the
        others go to the dlq).

        `block_ms` <= 0 does not block.
        """
        block = block_ms if block_ms > 0 else None
        reply = await self.redis.xread({self.key(stream): last_id}, count=count, block=block)
        events = []
        for raw_id, fields in stream_entries(reply):
            last_id = as_str(raw_id)
            delivery = await self._accept(stream, None, last_id, fields, times_delivered=1, check=check)
            if delivery is not None:
                events.append(delivery.event)
        return last_id, events

    async def dead_letter(self, stream: str, entry_id: str, payload: bytes | None, reason: str) -> None:
        """Record an unprocessable entry in the job's dlq stream with the reason."""
        fields: dict[str, str | bytes] = {"stream": stream, "entry_id": entry_id, "reason": reason}
        if payload is not None:
            fields["payload"] = payload
        await self.redis.xadd(self.key(DLQ), fields, maxlen=DLQ_KEPT, approximate=True)

    async def trim_acked(self, stream: str) -> int:
        """XTRIM MINID to the oldest entry some group has not acked; returns the number of entries removed.

        A stream without groups is never trimmed: nobody has acked anything. Every group of a stream must exist
        before its entries are trimmed (each of jetroll's group-read streams has one group, created by its consumer
        before it reads), since a group created later starts at what is left.
        """
        key = self.key(stream)
        groups = await self.redis.xinfo_groups(key)
        if not groups:
            return 0
        boundaries = []
        for info in groups:
            # Everything up to last-delivered-id that is not pending has been acked by this group.
            boundary = _next_id(as_str(info["last-delivered-id"]))
            if int(info["pending"]):
                summary = await self.redis.xpending(key, info["name"])
                if summary["min"] is not None:  # None: acked since XINFO, e.g. by a concurrent ack of this consumer
                    boundary = min(boundary, as_str(summary["min"]), key=_id_tuple)
            boundaries.append(boundary)
        min_id = min(boundaries, key=_id_tuple)
        return int(await self.redis.xtrim(key, minid=min_id, approximate=False))

    async def trim_before(self, stream: str, entry_id: str, keep_s: float) -> int:
        """XTRIM MINID: drop the entries more than `keep_s` older than `entry_id` (an id's first part is the server's
        clock in ms); returns the number removed. A tailing reader trims behind what it has read."""
        ms, _ = _id_tuple(entry_id)
        min_id = f"{max(0, ms - round(keep_s * 1000))}-0"
        return int(await self.redis.xtrim(self.key(stream), minid=min_id, approximate=False))

    async def memory(self) -> dict[str, Any]:
        """The server's `used_memory` and the MEMORY USAGE of each of this job's keys (every element counted), in
        bytes: {"used_memory_bytes", "job_keys_bytes" (their sum), "keys": {short name: bytes}}. Per-item keys
        (a reward backend's records, `reward:celery:<traj_id>:<attempt>`) are summed as `reward:celery:*`."""
        prefix = self.key("")
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"  # a job_id is matched literally
        names = sorted({as_str(key) async for key in self.redis.scan_iter(match=pattern, count=1000)})
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.memory_usage(name, samples=0)
            sizes = await pipe.execute()
        keys: dict[str, int] = {}
        for name, size in zip(names, sizes, strict=True):
            parts = name.removeprefix(prefix).split(":")
            short = ":".join(parts) if len(parts) <= 2 else ":".join([*parts[:2], "*"])
            keys[short] = keys.get(short, 0) + int(size or 0)
        used = int((await self.redis.info("memory"))["used_memory"])
        return {"used_memory_bytes": used, "job_keys_bytes": sum(keys.values()), "keys": keys}

    async def server_run_id(self) -> str:
        """The Redis server's run id, new with every start of the server: a change says it restarted, maybe from a
        file that lost its last second of writes."""
        return str((await self.redis.info("server"))["run_id"])

    async def close(self) -> None:
        await self.redis.aclose()
