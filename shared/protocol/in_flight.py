"""The in-flight index, which the staleness bound rests on, and the admission counter beside it.

The index is a sorted set, group_id -> the oldest version the group's tokens can carry, over groups admitted but not
yet trained or dropped:
- the controller adds a group at v_adm, in the transaction that publishes it;
- a rollout worker lowers the score to the version it starts the group with (it may not have swapped to v_adm yet);
- the trainer removes the group in the transaction that records it in the ledger (ledger.py), and waits for any
  group that would otherwise pass eta_hard.
"""

from __future__ import annotations

from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import GroupEvent
from jetroll.shared.protocol.topology import IN_FLIGHT, NUM_ADMITTED, groups_stream


class InFlightIndex:
    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus

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
        await self.bus.publish_counted(by_stream, IN_FLIGHT, {e.group_id: e.v_adm for e in events}, NUM_ADMITTED,
                                       expected=num_admitted, count=num_indices)

    async def started(self, group_ids: list[str], version: int) -> None:
        """A worker starts these groups at `version`: lower their scores to it (never raise them, never re-add)."""
        if group_ids:
            await self.bus.redis.zadd(self.bus.key(IN_FLIGHT), dict.fromkeys(group_ids, version), xx=True, lt=True)

    async def members(self) -> set[str]:
        return {member.decode() for member in await self.bus.redis.zrange(self.bus.key(IN_FLIGHT), 0, -1)}

    async def oldest_at_or_below(self, version: int, limit: int) -> list[str]:
        """Up to `limit` groups, the oldest first, whose tokens may carry `version` or older."""
        ids = await self.bus.redis.zrangebyscore(self.bus.key(IN_FLIGHT), "-inf", version, start=0, num=limit)
        return [i.decode() for i in ids]
