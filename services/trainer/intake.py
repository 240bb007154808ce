"""The intake: scored trajectories in, complete groups out. It reads the scored stream all along (steps included),
takes over an earlier life's pending entries, keeps the claims of what it holds alive, drops groups that failed or
can never complete, and hands the trainer B groups with the oldest v_adm first, waiting for any in-flight group
that must join the step under eta_hard."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable

from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.claims import HeldClaims
from jetroll.shared.protocol.events import ScoredEvent
from jetroll.shared.protocol.in_flight import InFlightIndex
from jetroll.shared.protocol.ledger import Ledger, Outcome
from jetroll.shared.protocol.topology import TRAJ_SCORED
from jetroll.shared.protocol.validate import EventLimits, check_scored, expecting
from jetroll.shared.rl.batch import GroupBuffer, PendingGroup

log = logging.getLogger("jetroll.trainer")

STREAM, GROUP = TRAJ_SCORED.name, TRAJ_SCORED.group


class Intake:
    def __init__(self, config: TrainerSections, bus: RedisBus, consumer: str, ledger: Ledger, limits: EventLimits,
                 version_now: Callable[[], int]) -> None:
        self.config = config
        self.bus = bus
        self.consumer = consumer
        self.ledger = ledger
        self.version_now = version_now  # the trainer's current version
        self.in_flight = InFlightIndex(bus, config.in_flight_slack)
        self.buffer = GroupBuffer()
        self.quotas = config.task_quotas
        # the groups of the step in progress and of the commit in the background, acked once recorded
        self.training: dict[str, PendingGroup] = {}
        self.stale_wait_s = 0.0  # waiting on an in-flight group that must join the step, with B groups at hand
        self.claims = HeldClaims(bus, STREAM, GROUP, consumer, config.redis.claim_idle_ms)
        self.ingested = asyncio.Event()  # set after each read of the scored stream
        self.task: asyncio.Task[None] | None = None
        self.is_reading = False
        self.has_taken_over = False
        self.invalid: dict[str, str] = {}  # traj_id -> group_id of scored events dead-lettered since the last read

        def check(event: ScoredEvent) -> str | None:
            # tokens come only from published versions: none newer than the trainer's own
            reason = check_scored(event, limits, self.version_now())
            if reason is not None:
                self.invalid[event.trajectory.traj_id] = event.trajectory.group_id
            return reason

        self.is_scored = expecting(ScoredEvent, check)

    def start(self) -> None:
        self.is_reading = True
        self.task = asyncio.create_task(self._read_while_training())

    async def stop(self) -> None:
        """The reader ends after its current read; a cancel could be lost inside redis-py on Python 3.11."""
        self.is_reading = False
        if self.task is not None:
            await asyncio.wait({self.task})

    async def next_groups(self, watched: asyncio.Task[None] | None) -> list[PendingGroup]:
        """B complete groups, oldest v_adm first; waits while an in-flight group that must join this step is not
        complete, even with B other groups at hand. A failure of `watched` (the commit in the background) surfaces
        here too."""
        self.stale_wait_s = 0.0
        needed = self.config.trainer.groups_per_step
        while (groups := self.buffer.take_oldest(needed, await self._required_groups(), self.quotas)) is None:
            waited = time.perf_counter()
            is_stale_wait = self.buffer.num_complete >= needed
            await self._next_read(watched)
            if watched is not None and watched.done():
                watched = None  # it finished well (`_next_read` raised otherwise): nothing more to watch
            if is_stale_wait:
                self.stale_wait_s += time.perf_counter() - waited
        self.training |= {g.group_id: g for g in groups}
        return groups

    def release(self, group_ids: Iterable[str]) -> None:
        """The groups of a recorded step: the ledger holds them now, so a copy that comes back is acked there."""
        for group_id in group_ids:
            del self.training[group_id]

    async def _next_read(self, watched: asyncio.Task[None] | None) -> None:
        assert self.task is not None
        self.ingested.clear()
        waiter = asyncio.ensure_future(self.ingested.wait())
        await asyncio.wait({waiter, self.task, *([watched] if watched else [])}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self.task.done():
            self.task.result()
        if watched is not None and watched.done():
            watched.result()

    async def _read_while_training(self) -> None:
        while self.is_reading:
            await self.read()
            self.ingested.set()

    async def read(self) -> None:
        """One read of the scored stream into the buffer; a copy of a traj_id already held or recorded is acked."""
        held = itertools.chain(self.buffer.groups.values(), self.training.values())
        await self.claims.keep(i for g in held for i in g.entry_ids)  # read only when the claims are due
        if self.has_taken_over:
            deliveries = await self.bus.consume(STREAM, GROUP, self.consumer, count=256, block_ms=500,
                                                check=self.is_scored)
        else:  # the trainer is the group's only consumer: what is pending is an earlier life's, so ours now
            deliveries = await self.bus.take_over(STREAM, GROUP, self.consumer, check=self.is_scored)
            self.has_taken_over = True
        if not deliveries:
            return
        done = await self.ledger.recorded({d.event.trajectory.group_id for d in deliveries}) | set(self.training)
        for delivery in deliveries:
            event = delivery.event
            assert isinstance(event, ScoredEvent)  # `is_scored` dead-lettered anything else
            if self._held_entry(event) == delivery.entry_id:
                continue  # our own held entry handed back by XAUTOCLAIM: it stays pending until trained
            if event.trajectory.group_id in done or not self.buffer.add(delivery.entry_id, event):
                await self.bus.ack(STREAM, GROUP, delivery.entry_id)  # a reclaimed copy: keep the first
        await self._drop_failed()
        if self.invalid:
            await self._drop_invalid()

    async def _drop_invalid(self) -> None:
        """Drop each in-flight group whose missing sample came only as a dead-lettered event: it could never
        complete, and the eta_hard wait would wait on it for good. An invalid copy of a sample already held is
        only dead-lettered."""
        invalid, self.invalid = self.invalid, {}
        live, done = await self.in_flight.members(), await self.ledger.recorded(set(invalid.values()))
        dropped: dict[str, PendingGroup | None] = {}
        for traj_id, group_id in invalid.items():
            held = self.buffer.groups.get(group_id)
            if group_id in live and group_id not in done and group_id not in self.training and \
                    not (held and traj_id in held.samples):
                dropped[group_id] = self.buffer.groups.pop(group_id, None)
        if not dropped:
            return
        log.warning("dropping %d groups with an invalid sample (see the dlq): %s", len(dropped), sorted(dropped))
        await self.ledger.record({g: Outcome(self.version_now(), "dropped:invalid", len(p.samples) if p else 0)
                                  for g, p in dropped.items()}, keep_groups=self.config.redis.ledger_keep_groups)
        await self.bus.ack(STREAM, GROUP, *(i for p in dropped.values() if p for i in p.entry_ids))

    async def _required_groups(self) -> frozenset[str]:
        """In-flight groups this step must include: trained any later, their oldest tokens would lag more than
        eta_hard. At most B, the oldest; the rest cannot fit this step, and their late tokens get masked. A group of
        a step whose commit runs in the background stays in the index until recorded, but is trained already."""
        newest = self.version_now() - self.config.staleness.eta_hard
        if newest < 0:
            return frozenset()
        oldest = await self.in_flight.oldest_at_or_below(newest, self.config.trainer.groups_per_step +
                                                         len(self.training))
        return frozenset([g for g in oldest if g not in self.training][:self.config.trainer.groups_per_step])

    def _held_entry(self, event: ScoredEvent) -> str | None:
        group = self.buffer.groups.get(event.trajectory.group_id) or self.training.get(event.trajectory.group_id)
        held = group.samples.get(event.trajectory.traj_id) if group else None
        return held[0] if held else None

    async def _drop_failed(self) -> None:
        failed = self.buffer.take_failed()
        if not failed:
            return
        await self.ledger.record({g.group_id: Outcome(self.version_now(), f"dropped:{g.failed_status}", len(g.samples))
                                  for g in failed}, keep_groups=self.config.redis.ledger_keep_groups)
        await self.bus.ack(STREAM, GROUP, *(i for g in failed for i in g.entry_ids))
