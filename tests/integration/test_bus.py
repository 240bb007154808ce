"""RedisBus against real redis-servers: every test runs on each available version (6.2 and 7.x)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from jetroll.shared.protocol.bus import FIELD, RedisBus
from jetroll.shared.protocol.dead_letters import DeadLetters
from jetroll.shared.protocol.events import MetricsEvent, decode, encode

pytestmark = pytest.mark.integration

STREAM = "traj:raw"
GROUP = "router"


def metric(job_id: str, step: int) -> MetricsEvent:
    return MetricsEvent(job_id=job_id, service="test", values={"x": float(step)}, step=step, time=0.0)


def run_with_bus(url: str, body: Callable[[RedisBus], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        bus = RedisBus(url, f"test-{uuid.uuid4().hex[:8]}", **kwargs)
        try:
            await bus.ensure_group(STREAM, GROUP)
            await body(bus)
        finally:
            await bus.close()

    asyncio.run(main())


def test_publish_consume_ack_round_trip(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        await bus.ensure_group(STREAM, GROUP)  # a second create is a no-op
        ids = await bus.publish_many(STREAM, [metric(bus.job_id, i) for i in range(3)])
        ids.append(await bus.publish(STREAM, metric(bus.job_id, 3)))
        assert len(set(ids)) == 4
        assert (await bus.redis.xlen(bus.key(STREAM))) == 4  # namespaced key

        got = await bus.consume(STREAM, GROUP, "c1", count=10, block_ms=100)
        assert [d.entry_id for d in got] == ids
        assert [d.event.step for d in got] == [0, 1, 2, 3]
        assert all(d.times_delivered == 1 and d.event.job_id == bus.job_id for d in got)
        assert await bus.lag(STREAM, GROUP) == 4  # all pending until acked

        await bus.ack(STREAM, GROUP, *ids)
        assert await bus.lag(STREAM, GROUP) == 0
        assert await bus.consume(STREAM, GROUP, "c1", block_ms=50) == []
        assert await DeadLetters(bus).read() == []

    run_with_bus(any_redis_url, body)


def test_bad_entries_go_to_dlq_and_consumer_goes_on(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        key = bus.key(STREAM)
        garbage_id = _s(await bus.redis.xadd(key, {"e": b"\xc1not msgpack"}))
        no_field_id = _s(await bus.redis.xadd(key, {"x": b"1"}))
        bad_schema = msgspec.msgpack.encode(
            {
                "kind": "metrics",
                "schema": 99,
                "job_id": bus.job_id,
                "service": "s",
                "values": {"n": 1.0},
                "step": 0,
            }
        )
        bad_schema_id = _s(await bus.redis.xadd(key, {"e": bad_schema}))
        other_job_id = await bus.publish(STREAM, metric("some-other-job", 0))
        good_id = await bus.publish(STREAM, metric(bus.job_id, 7))

        got = await bus.consume(STREAM, GROUP, "c1", count=10, block_ms=100)
        assert [(d.entry_id, d.event.step) for d in got] == [(good_id, 7)]

        dlq = {rec["entry_id"]: rec for rec in await DeadLetters(bus).read()}
        assert set(dlq) == {garbage_id, no_field_id, bad_schema_id, other_job_id}
        assert all(rec["stream"] == STREAM for rec in dlq.values())
        assert dlq[garbage_id]["payload"] == b"\xc1not msgpack"
        assert "undecodable" in dlq[garbage_id]["reason"]
        assert "missing field 'e'" in dlq[no_field_id]["reason"]
        assert "payload" not in dlq[no_field_id]
        assert "unsupported schema 99" in dlq[bad_schema_id]["reason"]
        assert dlq[bad_schema_id]["payload"] == bad_schema
        assert "some-other-job" in dlq[other_job_id]["reason"]

        # The bad entries were acked; only the good one is pending.
        assert await bus.lag(STREAM, GROUP) == 1
        await bus.ack(STREAM, GROUP, good_id)
        assert await bus.lag(STREAM, GROUP) == 0

    run_with_bus(any_redis_url, body)


def test_dead_consumer_entries_are_reclaimed(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        ids = await bus.publish_many(STREAM, [metric(bus.job_id, i) for i in range(2)])
        first = await bus.consume(STREAM, GROUP, "dead", count=10, block_ms=100)
        assert [d.entry_id for d in first] == ids
        # Not idle long enough yet: the second consumer gets nothing.
        assert await bus.consume(STREAM, GROUP, "alive", block_ms=10) == []

        await asyncio.sleep(0.15)
        again = await bus.consume(STREAM, GROUP, "alive", count=10, block_ms=10)
        assert [d.entry_id for d in again] == ids
        assert [d.times_delivered for d in again] == [2, 2]
        assert [d.event for d in again] == [d.event for d in first]
        pending = await bus.redis.xpending_range(bus.key(STREAM), GROUP, min="-", max="+", count=10)
        assert {p["consumer"] for p in pending} == {b"alive"}

        await bus.ack(STREAM, GROUP, *ids)
        assert await bus.lag(STREAM, GROUP) == 0

    run_with_bus(any_redis_url, body, claim_idle_ms=50)


def test_reclaim_skips_deleted_entries(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        ids = await bus.publish_many(STREAM, [metric(bus.job_id, i) for i in range(2)])
        assert len(await bus.consume(STREAM, GROUP, "dead", count=10, block_ms=100)) == 2
        await bus.redis.xdel(bus.key(STREAM), ids[0])
        await asyncio.sleep(0.1)
        again = await bus.consume(STREAM, GROUP, "alive", count=10, block_ms=10)
        assert [d.entry_id for d in again] == [ids[1]]
        assert await DeadLetters(bus).read() == []
        assert await bus.lag(STREAM, GROUP) == 1  # the deleted entry no longer counts as pending
        await bus.ack(STREAM, GROUP, ids[1])
        assert await bus.lag(STREAM, GROUP) == 0

    run_with_bus(any_redis_url, body, claim_idle_ms=30)


def test_entry_goes_to_dlq_after_max_deliveries(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        entry_id = await bus.publish(STREAM, metric(bus.job_id, 5))
        good_id = None
        for attempt, consumer in enumerate(["c1", "c2"], start=1):
            got = await bus.consume(STREAM, GROUP, consumer, block_ms=50)
            assert [(d.entry_id, d.times_delivered) for d in got] == [(entry_id, attempt)]
            await asyncio.sleep(0.05)
            if attempt == 1:
                good_id = await bus.publish(STREAM, metric(bus.job_id, 6))
        # A third delivery would exceed max_deliveries=2: dead-lettered and acked; the next entry still flows.
        got = await bus.consume(STREAM, GROUP, "c3", block_ms=50)
        assert [d.entry_id for d in got] == [good_id]
        (rec,) = await DeadLetters(bus).read()
        assert rec["entry_id"] == entry_id and rec["reason"] == "max deliveries exceeded"
        assert decode(rec["payload"]) == metric(bus.job_id, 5)
        assert await bus.lag(STREAM, GROUP) == 1  # only good_id, pending

    run_with_bus(any_redis_url, body, claim_idle_ms=30, max_deliveries=2)


def test_lag_counts_unread_plus_pending(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        assert await bus.lag(STREAM, GROUP) == 0
        ids = await bus.publish_many(STREAM, [metric(bus.job_id, i) for i in range(6)])
        assert await bus.lag(STREAM, GROUP) == 6
        got = await bus.consume(STREAM, GROUP, "c1", count=2, block_ms=50)
        assert len(got) == 2
        assert await bus.lag(STREAM, GROUP) == 6  # 2 pending + 4 unread
        await bus.ack(STREAM, GROUP, *(d.entry_id for d in got))
        assert await bus.lag(STREAM, GROUP) == 4
        # A deletion makes 7.x report lag as null; the fallback still counts what is left.
        await bus.redis.xdel(bus.key(STREAM), ids[4])
        assert await bus.lag(STREAM, GROUP) == 3
        assert await bus.lag(STREAM, GROUP, scan_limit=2) == 2
        # XLEN would say 5; lag is per group and a fresh group sees them all.
        await bus.ensure_group(STREAM, "other")
        assert await bus.lag(STREAM, "other") == 5
        with pytest.raises(ValueError, match="no consumer group"):
            await bus.lag(STREAM, "missing")

    run_with_bus(any_redis_url, body, trim_every_s=None)  # a group created late must find the acked entries


def test_wait_for_capacity_blocks_until_acks(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        await bus.publish_many(STREAM, [metric(bus.job_id, i) for i in range(4)])
        waiter = asyncio.create_task(bus.wait_for_capacity(STREAM, GROUP, max_lag=3, poll_s=0.01))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        got = await bus.consume(STREAM, GROUP, "c1", count=2, block_ms=50)
        await asyncio.sleep(0.1)
        assert not waiter.done()  # consumed but not acked: still lag 4
        await bus.ack(STREAM, GROUP, *(d.entry_id for d in got))
        await asyncio.wait_for(waiter, timeout=2)
        assert await bus.lag(STREAM, GROUP) == 2

    run_with_bus(any_redis_url, body)


def test_trim_acked_keeps_everything_some_group_has_not_acked(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        key = bus.key(STREAM)
        await bus.ensure_group(STREAM, "g2")
        ids = await bus.publish_many(STREAM, [metric(bus.job_id, i) for i in range(6)])
        g1 = await bus.consume(STREAM, GROUP, "a", count=6, block_ms=50)
        await bus.ack(STREAM, GROUP, *ids[:4])  # ids[4:] pending in GROUP
        g2 = await bus.consume(STREAM, "g2", "b", count=3, block_ms=50)
        await bus.ack(STREAM, "g2", *(d.entry_id for d in g2))  # ids[3:] unread by g2
        assert len(g1) == 6

        assert await bus.trim_acked(STREAM) == 3
        assert [_s(i) for i, _ in await bus.redis.xrange(key)] == ids[3:]

        # A pending entry in the middle holds the line for everything after it.
        await bus.ack(STREAM, GROUP, ids[5])
        assert await bus.trim_acked(STREAM) == 0
        rest = await bus.consume(STREAM, "g2", "b", count=10, block_ms=50)
        await bus.ack(STREAM, "g2", *(d.entry_id for d in rest))
        assert await bus.trim_acked(STREAM) == 1
        assert [_s(i) for i, _ in await bus.redis.xrange(key)] == ids[4:]
        await bus.ack(STREAM, GROUP, ids[4])
        assert await bus.trim_acked(STREAM) == 2
        assert await bus.redis.xlen(key) == 0
        assert await bus.lag(STREAM, GROUP) == 0 and await bus.lag(STREAM, "g2") == 0

        # A stream nobody consumes through a group is never trimmed.
        await bus.publish("weights", metric(bus.job_id, 0))
        assert await bus.trim_acked("weights") == 0

    run_with_bus(any_redis_url, body, trim_every_s=None)


def test_acks_trim_past_the_slowest_group_and_keep_its_unacked_entries(any_redis_url: str) -> None:
    """Consumers trim as they ack (here on every ack): up to the oldest entry some group has not acked, so a slow
    group keeps what it has not read and what it has read but not acked (still there to reclaim)."""
    async def body(bus: RedisBus) -> None:
        key = bus.key(STREAM)
        await bus.ensure_group(STREAM, "slow")
        ids = await bus.publish_many(STREAM, [metric(bus.job_id, i) for i in range(8)])
        fast = await bus.consume(STREAM, GROUP, "a", count=8, block_ms=50)
        await bus.ack(STREAM, GROUP, *(d.entry_id for d in fast))
        assert await bus.redis.xlen(key) == 8  # the slow group has read nothing yet

        slow = await bus.consume(STREAM, "slow", "b", count=5, block_ms=50)
        await bus.ack(STREAM, "slow", ids[0], ids[1], ids[3])  # ids[2] and ids[4] pending, ids[5:] unread
        assert [_s(i) for i, _ in await bus.redis.xrange(key)] == ids[2:]
        assert [d.entry_id for d in slow] == ids[:5]

        # the dead consumer's pending entries are reclaimed whole, then the rest is read
        reclaimed = await bus.consume(STREAM, "slow", "c", count=8, block_ms=50)
        assert [(d.entry_id, d.event.step) for d in reclaimed] == [(ids[2], 2), (ids[4], 4)]
        await bus.ack(STREAM, "slow", ids[2])
        assert [_s(i) for i, _ in await bus.redis.xrange(key)] == ids[4:]
        await bus.ack(STREAM, "slow", ids[4])
        assert [_s(i) for i, _ in await bus.redis.xrange(key)] == ids[5:]
        rest = await bus.consume(STREAM, "slow", "c", count=8, block_ms=50)
        assert [d.entry_id for d in rest] == ids[5:]
        await bus.ack(STREAM, "slow", *ids[5:])
        assert await bus.redis.xlen(key) == 0
        assert await bus.lag(STREAM, GROUP) == 0 and await bus.lag(STREAM, "slow") == 0

    run_with_bus(any_redis_url, body, trim_every_s=0.0, claim_idle_ms=0)


def test_a_consumer_trims_a_stream_at_most_every_trim_every_s(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        ids = await bus.publish_many(STREAM, [metric(bus.job_id, i) for i in range(4)])
        await bus.consume(STREAM, GROUP, "a", count=4, block_ms=50)
        await bus.ack(STREAM, GROUP, ids[0])  # the first ack trims
        await bus.ack(STREAM, GROUP, *ids[1:])  # within the hour: no trim
        assert [_s(i) for i, _ in await bus.redis.xrange(bus.key(STREAM))] == ids[1:]

    run_with_bus(any_redis_url, body, trim_every_s=3600.0)


def test_tailed_streams_keep_the_newest_entries(any_redis_url: str) -> None:
    """`weights` keeps its newest N announcements as it is written; `metrics` is trimmed by its reader, behind what
    it has read, keeping a time window."""
    async def body(bus: RedisBus) -> None:
        ids = [await bus.publish("weights", metric(bus.job_id, i), maxlen=3) for i in range(5)]
        assert [_s(i) for i, _ in await bus.redis.xrange(bus.key("weights"))] == ids[2:]
        _, events = await bus.tail("weights")
        assert [e.step for e in events] == [2, 3, 4]

        key = bus.key("metrics")
        for ms in (1000, 5000, 7999, 8000, 9500, 12000):
            await bus.redis.xadd(key, {FIELD: encode(metric(bus.job_id, ms))}, id=f"{ms}-0")
        assert await bus.trim_before("metrics", "10000-3", keep_s=2.0) == 3
        _, events = await bus.tail("metrics")
        assert [e.step for e in events] == [8000, 9500, 12000]  # within 2 s of the reader, or after it
        assert await bus.trim_before("metrics", "0-0", keep_s=2.0) == 0  # a reader that has read nothing

    run_with_bus(any_redis_url, body)


def test_memory_reports_the_jobs_keys_by_size(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        other = RedisBus(any_redis_url, bus.job_id + "*")  # a glob character in a job_id is matched literally
        try:
            await other.publish("metrics", metric(other.job_id, 0))
            await bus.publish_many("traj:scored", [metric(bus.job_id, i) for i in range(50)])
            await bus.publish("metrics", metric(bus.job_id, 0))
            for traj_id in ("g1:0", "g1:1"):
                await bus.redis.set(bus.key(f"reward:lambda:{traj_id}"), "{}")
            memory = await bus.memory()
        finally:
            await other.redis.delete(other.key("metrics"))
            await other.close()
        assert set(memory["keys"]) == {STREAM, "traj:scored", "metrics", "reward:lambda:*"}  # STREAM: the group's
        assert memory["keys"]["traj:scored"] > memory["keys"]["metrics"] > 0
        assert memory["job_keys_bytes"] == sum(memory["keys"].values()) < memory["used_memory_bytes"]

    run_with_bus(any_redis_url, body)


def test_tail_reads_in_order_and_dead_letters_garbage(any_redis_url: str) -> None:
    async def body(bus: RedisBus) -> None:
        await bus.publish("metrics", metric(bus.job_id, 0))
        bad_id = _s(await bus.redis.xadd(bus.key("metrics"), {"e": b"junk"}))
        last = await bus.publish("metrics", metric(bus.job_id, 1))

        last_id, events = await bus.tail("metrics", block_ms=50)
        assert last_id == last
        assert [e.step for e in events] == [0, 1]
        (rec,) = await DeadLetters(bus).read()
        assert rec["entry_id"] == bad_id and rec["stream"] == "metrics"

        assert await bus.tail("metrics", last_id, block_ms=20) == (last_id, [])
        newer = await bus.publish("metrics", metric(bus.job_id, 2))
        assert await bus.tail("metrics", last_id, block_ms=0) == (newer, [metric(bus.job_id, 2)])

    run_with_bus(any_redis_url, body)


def test_redis_url_fixture_serves_a_real_server(redis_url: str) -> None:
    async def main() -> None:
        bus = RedisBus(redis_url, "v")
        try:
            version = (await bus.redis.info("server"))["redis_version"]
            assert int(str(version).split(".")[0]) >= 6
        finally:
            await bus.close()

    asyncio.run(main())


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
