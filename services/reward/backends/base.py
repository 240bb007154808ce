"""The reward backend seam: one interface, one implementation per backend (local pool, Celery, AWS Lambda).

A backend runs one call and reports what happened; it never retries (the router owns retries) and never turns a
failure into a reward. The package's `setup_backend` builds one by name.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

CallStatus = Literal["ok", "timeout", "error", "throttled"]
RECORD_TTL_S = 3600  # how long idempotency records (per traj_id) outlive their call: redeliveries come sooner


@dataclass(frozen=True, slots=True)
class RewardCall:
    """One attempt at scoring one trajectory; `attempt` counts from 1."""

    traj_id: str
    attempt: int
    reward: str
    completion: str
    answer: str

    def request(self) -> dict[str, Any]:
        """The JSON request every remote runner takes (jetroll.functions.runner.call_reward)."""
        return {"reward": self.reward, "completion": self.completion, "answer": self.answer, "traj_id": self.traj_id}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one call produced: a reward exactly when the status is ok; `detail` is the reward's note, or why not."""

    status: CallStatus
    reward: float | None = None
    correct: bool = False
    detail: str = ""

    def __post_init__(self) -> None:
        assert (self.status == "ok") == (self.reward is not None), self

    @classmethod
    def from_reply(cls, reply: Any) -> Outcome:
        """Validate an outcome that crossed a wire; anything malformed is an error, never a reward."""
        if not isinstance(reply, dict) or reply.get("status") not in ("ok", "timeout", "error"):
            return cls("error", detail=f"malformed reward reply: {reply!r:.200}")
        if reply["status"] != "ok":
            return cls(reply["status"], detail=str(reply.get("detail", "")))
        reward = reply.get("reward")
        # NaN and inf fail the range check too
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not 0.0 <= reward <= 1.0:
            return cls("error", detail=f"reward reply without a reward in [0, 1]: {reply!r:.200}")
        return cls("ok", float(reward), bool(reply.get("correct", False)), str(reply.get("details", "")))


class RewardBackend(ABC):
    """Runs reward calls with at most `concurrency` in flight. Use `async with backend:` (start, then close)."""

    name: ClassVar[str]
    can_retry_failures: ClassVar[bool] = True  # may the router re-run a call that timed out or errored?

    def __init__(self, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"{self.name} concurrency must be >= 1, got {concurrency}")
        self.concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)

    async def score(self, call: RewardCall) -> Outcome:
        async with self._slots:
            return await self._score(call)

    @abstractmethod
    async def _score(self, call: RewardCall) -> Outcome: ...

    async def start(self) -> None:  # noqa: B027 - an optional hook
        """Open clients; called once before the first call."""

    async def close(self) -> None:  # noqa: B027 - an optional hook
        """Release clients and processes."""

    async def __aenter__(self) -> RewardBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
