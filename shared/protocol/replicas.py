"""The weight version each Ray rollout replica decodes with (hash REPLICAS): a replica reports its own and withdraws
it on a clean stop; the launcher clears the hash after the job, since a replica that crashed leaves its entry."""

from __future__ import annotations

from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.topology import REPLICAS


class ReplicaVersions:
    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus

    async def report(self, replica: str, version: int) -> None:
        await self.bus.redis.hset(self.bus.key(REPLICAS), replica, version)

    async def withdraw(self, replica: str) -> None:
        await self.bus.redis.hdel(self.bus.key(REPLICAS), replica)

    async def all(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in (await self.bus.redis.hgetall(self.bus.key(REPLICAS))).items()}

    async def clear(self) -> None:
        await self.bus.redis.delete(self.bus.key(REPLICAS))
