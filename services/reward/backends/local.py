"""The local backend: the in-host reward process pool."""

from __future__ import annotations

from jetroll.services.reward.backends.base import Outcome, RewardBackend, RewardCall
from jetroll.services.reward.pool import RewardPool


class LocalBackend(RewardBackend):
    """The in-host process pool; it owns `pool` and closes it."""

    name = "local"

    def __init__(self, pool: RewardPool) -> None:
        super().__init__(pool.num_workers)
        self.pool = pool

    async def _score(self, call: RewardCall) -> Outcome:
        status, out, detail = await self.pool.score(call.reward, call.completion, call.answer)
        if status == "ok":
            assert out is not None
            return Outcome("ok", out.reward, out.correct, out.details)
        return Outcome(status, detail=detail)

    async def close(self) -> None:
        self.pool.close()
