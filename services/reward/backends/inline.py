"""The inline backend: each reward called in the router's own process, without the pool's process hop."""

from __future__ import annotations

import time
from collections.abc import Sequence

from jetroll.functions.runner import call_reward, import_reward_modules
from jetroll.services.reward.backends.base import Outcome, RewardBackend, RewardCall


class InlineBackend(RewardBackend):
    """For cheap rewards the job trusts (the builtin ones take microseconds): a call runs on the router's event loop,
    one at a time, with no isolation. A reward that raises is an error; one that overruns `timeout_s` cannot be
    stopped (it holds the router while it runs) and its result counts as a timeout."""

    name = "inline"

    def __init__(self, timeout_s: float, modules: Sequence[str] = ()) -> None:
        super().__init__(1)
        self.timeout_s = timeout_s
        import_reward_modules(",".join(modules))

    async def _score(self, call: RewardCall) -> Outcome:
        started = time.perf_counter()
        try:
            reply = {"status": "ok", **call_reward(call.request())}
        except Exception as exc:  # a failing reward is a status, and the router lives on
            return Outcome("error", detail=f"{type(exc).__name__}: {exc}")
        elapsed = time.perf_counter() - started
        if elapsed > self.timeout_s:
            return Outcome("timeout", detail=f"inline reward {call.reward!r} took {elapsed:.2f} s, "
                                             f"exceeded timeout_s {self.timeout_s}")
        return Outcome.from_reply(reply)
