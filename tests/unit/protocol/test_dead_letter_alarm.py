"""The dead-letter alarm, on a real Redis: a run of windows in which more events went to the dlq than
samples were recorded fails the job once it holds `min_dead` dead letters; a window with progress ends the run."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from jetroll.shared.errors import JobFailedError
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.dead_letters import DeadLetterAlarm, DeadLetters

pytestmark = pytest.mark.integration


async def dead_letter(bus: RedisBus, num: int, reason: str = "undecodable event: x") -> None:
    for i in range(num):
        await bus.dead_letter("traj:raw", f"1-{i}", None, reason)


@pytest.mark.parametrize(("windows", "fails_at"), [
    ([(150, 0), (100, 10)], 2),  # slow but steady: the run of windows adds up
    ([(150, 0), (100, 500), (150, 0)], None),  # the second window made progress: the run starts again
    ([(199, 0)], None),
    ([(5000, 4000)], 1),  # one flood outnumbering the samples
])
def test_the_alarm_counts_dead_letters_over_windows_without_progress(
    windows: list[tuple[int, int]], fails_at: int | None, redis_url: str
) -> None:
    async def body() -> int | None:
        bus = RedisBus(redis_url, f"a{uuid.uuid4().hex[:8]}")
        try:
            await dead_letter(bus, 7, "left by an earlier life")
            alarm = DeadLetterAlarm(DeadLetters(bus), 200, await DeadLetters(bus).newest_id(), num_recorded=1000)
            recorded = 1000
            for window, (num_dead, num_samples) in enumerate(windows, start=1):
                await dead_letter(bus, num_dead)
                recorded += num_samples
                try:
                    await alarm.check(recorded)
                except JobFailedError as exc:
                    assert "traj:raw: undecodable event: x" in str(exc) and "earlier life" not in str(exc)
                    return window
            return None
        finally:
            await bus.close()

    assert asyncio.run(body()) == fails_at
