"""Reading a job's dlq: its records, counts by kind of reason, and the alarm that fails a job drowning in them.
(The bus writes dead letters: `RedisBus.dead_letter`.)"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable

from jetroll.shared.errors import JobFailedError
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.client import as_str
from jetroll.shared.protocol.topology import DLQ

ALARM_WINDOW_S = 10.0  # the dead-letter alarm compares the dlq's growth with the samples recorded over this


class DeadLetters:
    """The job's dlq stream, read."""

    def __init__(self, bus: RedisBus) -> None:
        self.redis, self.key = bus.redis, bus.key(DLQ)

    async def newest_id(self) -> str:
        """The id of the newest record ("0-0" for none): where a reader of only new dead letters starts."""
        newest = await self.redis.xrevrange(self.key, count=1)
        return as_str(newest[0][0]) if newest else "0-0"

    async def after(self, last_id: str, count: int) -> tuple[str, list[dict[str, str]]]:
        """Up to `count` records after `last_id`, without payloads: the new last id, and their stream and reason.
        (The dlq is capped, so its length stops counting; ids do not.)"""
        entries = await self.redis.xrange(self.key, min=f"({last_id}", count=count)
        if not entries:
            return last_id, []
        records = [{name: as_str(fields.get(name.encode(), b"")) for name in ("stream", "reason")}
                   for _, fields in entries]
        return as_str(entries[-1][0]), records

    async def read(self) -> list[dict[str, str | bytes]]:
        """All records, oldest first; `payload` stays bytes, other fields are str."""
        out = []
        for raw_id, fields in await self.redis.xrange(self.key):
            record: dict[str, str | bytes] = {"dlq_id": as_str(raw_id)}
            for name, value in fields.items():
                record[as_str(name)] = value if name == b"payload" else as_str(value)
            out.append(record)
        return out


def dead_letter_counts(records: Iterable[dict[str, str | bytes]]) -> dict[str, int]:
    """Dead letters by stream and kind of reason, most first: a reason's numbers and quoted values are elided, so
    `v_tok spans versions 7..9, outside 0..4` and `... 8..8, outside 0..4` count as one kind."""
    counts: Counter[str] = Counter()
    for record in records:
        reason = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", str(record.get("reason", "")))
        reason = re.sub(r"-?\d+(\.\d+)?", "N", reason)
        counts[f"{record.get('stream', '?')}: {reason}"] += 1
    return dict(counts.most_common())


class DeadLetterAlarm:
    """Fails the job when most of its events go to the dlq: `min_dead` dead letters over consecutive windows of
    ALARM_WINDOW_S, in each of which fewer samples were recorded (trained or dropped) than dead-lettered. A version
    skew between services looks like this, fast or slow, and would otherwise stall the job for good."""

    def __init__(self, dead_letters: DeadLetters, min_dead: int, last_id: str, num_recorded: int) -> None:
        self.dead_letters, self.min_dead = dead_letters, min_dead
        self.last_id, self.num_recorded, self.checked_at = last_id, num_recorded, time.monotonic()
        self.suspect: list[dict[str, str]] = []  # dead letters of the current run of such windows

    def is_due(self) -> bool:
        return time.monotonic() - self.checked_at >= ALARM_WINDOW_S

    async def check(self, num_recorded: int) -> None:
        self.last_id, dead = await self.dead_letters.after(self.last_id, count=100_000)
        num_new = num_recorded - self.num_recorded
        self.num_recorded, self.checked_at = num_recorded, time.monotonic()
        self.suspect = self.suspect + dead if len(dead) > num_new else []
        if len(self.suspect) >= self.min_dead:
            common, count = next(iter(dead_letter_counts(self.suspect).items()))
            raise JobFailedError(
                f"{len(self.suspect)} events went to the dlq, more than the samples recorded in each "
                f"{ALARM_WINDOW_S:.0f} s meanwhile (redis.dlq_alarm_min={self.min_dead}); most often ({count}): "
                f"{common}. A version skew between services? See `jetroll dlq`")
