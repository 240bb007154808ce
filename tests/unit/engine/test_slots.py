"""The slot table without a model: a cache that records which sequence's KV each slot holds shows that every move
keeps running[i] in slot i and paused[j] in slot num_slots - 1 - j."""

from __future__ import annotations

import random

from jetroll.shared.engine.request import Request
from jetroll.shared.engine.slots import SlotTable


class RecordingCache:
    def __init__(self, num_slots: int) -> None:
        self.holds: list[str | None] = [None] * num_slots

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.holds[dst] = self.holds[src]

    def swap_slots(self, a: int, b: int, length: int) -> None:
        self.holds[a], self.holds[b] = self.holds[b], self.holds[a]


def check(table: SlotTable, cache: RecordingCache) -> None:
    assert [cache.holds[i] for i in range(len(table.running))] == [r.request_id for r in table.running]
    assert [cache.holds[table.paused_slot(j)] for j in range(len(table.paused))] == [
        r.request_id for r in table.paused]
    assert table.num_held <= table.num_slots


def test_every_move_keeps_each_sequence_in_its_slot() -> None:
    rng = random.Random(0)
    cache = RecordingCache(6)
    table = SlotTable(6, cache)
    for step in range(400):
        move = rng.choice(("add", "release", "pause", "resume", "finish"))
        if move == "add" and table.num_held < table.num_slots:
            request = Request(f"r{step}", [1, 2], 8)
            cache.holds[len(table.running)] = request.request_id  # prefill writes the next running slot
            table.running.append(request)
        elif move == "release" and table.running:
            table.release(rng.randrange(len(table.running)))
        elif move == "pause" and table.running:
            table.pause(rng.randrange(len(table.running)))
        elif move == "resume" and table.paused and table.num_held <= table.num_slots:
            request = rng.choice(table.paused)
            slot = len(table.running)
            table.take_paused(request, to_slot=slot)
            table.running.append(request)
        elif move == "finish" and table.paused:
            table.take_paused(rng.choice(table.paused))
        check(table, cache)


def test_a_finished_sequence_in_the_last_slot_is_dropped_without_a_copy() -> None:
    cache = RecordingCache(3)
    table = SlotTable(3, cache)
    for i in range(3):
        cache.holds[i] = f"r{i}"
        table.running.append(Request(f"r{i}", [1], 4))
    table.release(2)
    assert cache.holds == ["r0", "r1", "r2"] and [r.request_id for r in table.running] == ["r0", "r1"]
    table.release(0)  # the last one moves into the freed slot
    assert cache.holds[0] == "r1" and [r.request_id for r in table.running] == ["r1"]
