"""The in-flight index, which the staleness bound rests on, and the admission counter beside it.

The index is a sorted set, group_id -> the oldest version the group's tokens can carry, plus its task's slack, over
groups admitted but not yet trained or dropped:
- the controller adds a group at v_adm, in the transaction that publishes it;
- a rollout worker lowers the score to the version it starts the group with (it may not have swapped to v_adm yet);
- the trainer removes the group in the transaction that records it in the ledger (ledger.py), and waits for any
  group that would otherwise pass eta_hard.
A task with its own staleness bound (`tasks[].max_staleness`) has a slack of its eta_hard minus the job's, so one
query at the job's eta_hard finds every group due, whatever its task's bound.
"""

from __future__ import annotations

from collections.abc import Mapping

from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import GroupEvent
from jetroll.shared.protocol.topology import IN_FLIGHT, NUM_ADMITTED, groups_stream


class InFlightIndex:
    def __init__(self, bus: RedisBus, slack: Mapping[str, int] | None = None) -> None:
        self.bus = bus
        self.slack = slack or {}  # task -> versions added to its groups' scores (rl/admission.py's in_flight_slack)

    async def num_admitted(self) -> int:
        """Groups admitted by every life of the controller so far."""
        return int(await self.bus.redis.get(self.bus.key(NUM_ADMITTED)) or 0)

    async def admit(self, events: list[GroupEvent], num_admitted: int, num_indices: int) -> None:
        """Publish groups on their pools' streams, each indexed at its v_adm, and count `num_indices` admissions
        (these groups, and indices whose groups are recorded already), in one transaction: a controller killed
        mid-admission leaves all of them or none, so the count it restores from names only published groups.
        `num_admitted` is the count before them; another controller of the job is refused."""
        by_stream: dict[str, list[GroupEvent]] = {}
        for event in events:
            by_stream.setdefault(groups_stream(event.pool).name, []).append(event)
        scores = {e.group_id: e.v_adm + self.slack.get(e.task, 0) for e in events}
        await self.bus.publish_counted(by_stream, IN_FLIGHT, scores, NUM_ADMITTED, expected=num_admitted,
                                       count=num_indices)

    async def started(self, groups: list[GroupEvent], version: int) -> None:
        """A worker starts these groups at `version`: lower their scores to it (never raise them, never re-add)."""
        if groups:
            scores = {g.group_id: version + self.slack.get(g.task, 0) for g in groups}
            await self.bus.redis.zadd(self.bus.key(IN_FLIGHT), scores, xx=True, lt=True)

    async def members(self) -> set[str]:
        return {member.decode() for member in await self.bus.redis.zrange(self.bus.key(IN_FLIGHT), 0, -1)}

    async def oldest_at_or_below(self, version: int, limit: int) -> list[str]:
        """Up to `limit` groups, the oldest first, whose tokens may carry `version` or older (`version` plus its
        slack, for a task with one)."""
        ids = await self.bus.redis.zrangebyscore(self.bus.key(IN_FLIGHT), "-inf", version, start=0, num=limit)
        return [i.decode() for i in ids]
