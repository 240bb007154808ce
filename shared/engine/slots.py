"""The slot table: which KV-cache slot holds which sequence, with no model in it.

Running sequences fill slots [0, n) in order, so a decode step attends over a prefix of the cache with no gather;
a finished sequence's slot is refilled by moving the last one into it. Multi-turn sequences paused on their
environment keep their KV at the top: paused[j] lives in slot num_slots - 1 - j."""

from __future__ import annotations

from typing import Protocol

from jetroll.shared.engine.request import Request


class SlotCache(Protocol):
    """The cache operations the table needs (a KVCache; any recorder in tests)."""

    def copy_slot(self, src: int, dst: int, length: int) -> None: ...

    def swap_slots(self, a: int, b: int, length: int) -> None: ...


class SlotTable:
    def __init__(self, num_slots: int, cache: SlotCache) -> None:
        self.num_slots = num_slots
        self.cache = cache
        self.running: list[Request] = []  # running[i] lives in cache slot i
        self.paused: list[Request] = []  # paused[j] lives in cache slot num_slots - 1 - j, awaiting its environment

    @property
    def num_held(self) -> int:
        return len(self.running) + len(self.paused)

    def paused_slot(self, index: int) -> int:
        return self.num_slots - 1 - index

    def release(self, slot: int) -> None:
        """Drop running[slot] (it finished); the last running sequence moves into its slot."""
        last = len(self.running) - 1
        if slot != last:
            moved = self.running[last]
            self.cache.copy_slot(last, slot, moved.num_tokens)
            self.running[slot] = moved
        self.running.pop()

    def pause(self, slot: int) -> None:
        """Move running[slot] (it ended a turn) to the lowest free slot of the paused region, KV cache and all."""
        request, last = self.running[slot], len(self.running) - 1
        if slot != last:  # swap it with the last running sequence: the paused region may start at `last`
            self.cache.swap_slots(slot, last, max(request.num_tokens, self.running[last].num_tokens))
            self.running[slot], self.running[last] = self.running[last], request
        self.running.pop()
        top = self.paused_slot(len(self.paused))
        if top != last:
            self.cache.copy_slot(last, top, request.num_tokens)
        self.paused.append(request)

    def take_paused(self, request: Request, to_slot: int | None = None) -> None:
        """Remove a paused sequence, keeping the paused ones contiguous at the top; copy its cache to `to_slot`."""
        index, lowest = self.paused.index(request), len(self.paused) - 1
        if index != lowest:  # swap it with the lowest paused sequence, which is the one that stays put
            self.cache.swap_slots(self.paused_slot(index), self.paused_slot(lowest),
                                  max(request.num_tokens, self.paused[lowest].num_tokens))
            self.paused[index], self.paused[lowest] = self.paused[lowest], request
        self.paused.pop()
        if to_slot is not None and to_slot != self.paused_slot(lowest):
            self.cache.copy_slot(self.paused_slot(lowest), to_slot, request.num_tokens)
