"""Claims on a job's entries: the first entry to carry a member claims it (later entries carrying it are copies), and
a consumer's entries still being worked on are kept claimed."""

from __future__ import annotations

import time
from collections.abc import Iterable

from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.client import as_str


class FirstClaims:
    """The hash `name` of the job (e.g. `seen:reward`: traj_id -> the entry that first carried it)."""

    def __init__(self, bus: RedisBus, name: str) -> None:
        self.redis, self.key = bus.redis, bus.key(name)

    async def claim_first(self, claims: dict[str, str]) -> set[str]:
        """For many members in two round trips: of `claims` (member -> entry id), the members whose entry is the
        first to claim them (a redelivery of that same entry included); any other entry carrying a member is a
        copy."""
        if not claims:
            return set()
        members = list(claims)
        async with self.redis.pipeline(transaction=False) as pipe:
            for member in members:
                pipe.hsetnx(self.key, member, claims[member])
            is_new = await pipe.execute()
        owned = {member for member, new in zip(members, is_new, strict=True) if new}
        taken = [member for member in members if member not in owned]
        if taken:
            owners = await self.redis.hmget(self.key, taken)
            owned |= {member for member, owner in zip(taken, owners, strict=True)
                      if owner is not None and as_str(owner) == claims[member]}
        return owned

    async def claimed(self) -> list[str]:
        """The members claimed now."""
        return [as_str(member) for member in await self.redis.hkeys(self.key)]

    async def release(self, members: list[str]) -> None:
        """Forget the claims of `members`: the next entry carrying one claims it anew."""
        if members:
            await self.redis.hdel(self.key, *members)


class HeldClaims:
    """A consumer's entries of one stream that it still works on: `keep` resets their idle time once a third of
    `claim_idle_ms` has passed since the last, so XAUTOCLAIM never hands them to another consumer, or back to this
    one."""

    def __init__(self, bus: RedisBus, stream: str, group: str, consumer: str, claim_idle_ms: int) -> None:
        self.bus, self.stream, self.group, self.consumer = bus, stream, group, consumer
        self.every_s = claim_idle_ms / 3000
        self.kept_at = time.monotonic()

    async def keep(self, entry_ids: Iterable[str]) -> None:
        """`entry_ids` is read only when the claims are due (a generator costs nothing in between)."""
        if time.monotonic() - self.kept_at >= self.every_s:
            await self.bus.keep_claimed(self.stream, self.group, self.consumer, sorted(entry_ids))
            self.kept_at = time.monotonic()
