"""The agents' HTTP contract, which the gateway (the server) and the agent side (the client) both import: where a
session lives, the keys each endpoint takes, and the body that ends a session.

A gateway at `{url}` serves each session under `{url}/sessions/{session_id}`: the OpenAI API at `.../v1`
(`chat/completions`, `completions`), and `POST .../end` with the episode's outcome. An agent is handed the API base;
the end is beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

API = "/v1"  # a session's OpenAI-compatible API, under its root
CHAT_ROUTE = "/sessions/{session_id}/v1/chat/completions"
COMPLETIONS_ROUTE = "/sessions/{session_id}/v1/completions"
END_ROUTE = "/sessions/{session_id}/end"
HEALTH_ROUTE = "/health"

ROLES = frozenset({"system", "user", "assistant", "tool"})
CHAT_KEYS = frozenset({"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
                       "max_completion_tokens", "stop", "logprobs", "top_logprobs", "n", "stream", "user"})
COMPLETION_KEYS = frozenset({"model", "prompt", "temperature", "top_p", "max_tokens", "stop", "logprobs", "n",
                             "stream", "user", "echo"})
END_KEYS = frozenset({"status", "reward", "reason"})
END_STATUSES = frozenset({"ok", "error", "timeout"})


def session_url(gateway_url: str, session_id: str) -> str:
    """The API base an agent of the session is handed (an episode event's `url`)."""
    return f"{gateway_url}/sessions/{session_id}{API}"


def end_url(api_url: str) -> str:
    """Where the session whose API base is `api_url` is ended."""
    if not api_url.endswith(API):
        raise ValueError(f"{api_url!r} is not a session's API base (it ends with {API})")
    return api_url.removesuffix(API) + "/end"


class BadEnd(ValueError):
    """An end body the gateway refuses: an OpenAI-style error code and the reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class EpisodeOutcome:
    """How an agent's episode ended: the end body. `reward` is the agent's, in [0, 1], or None."""

    status: str  # ok | error | timeout
    reward: float | None = None
    reason: str = ""

    def body(self) -> dict[str, Any]:
        return {"status": self.status, "reward": self.reward, "reason": self.reason}

    @classmethod
    def parse(cls, body: dict[str, Any]) -> EpisodeOutcome:
        """The outcome an end body holds; BadEnd naming what is wrong with it."""
        status, reward, reason = body.get("status"), body.get("reward"), body.get("reason", "")
        if status not in END_STATUSES:
            raise BadEnd("invalid_status", f"status must be one of {sorted(END_STATUSES)}, not {status!r}")
        if reward is not None and not (isinstance(reward, int | float) and math.isfinite(reward) and 0 <= reward <= 1):
            raise BadEnd("invalid_reward", f"reward must be a number in [0, 1] or null, not {reward!r}")
        if not isinstance(reason, str):
            raise BadEnd("invalid_reason", "reason must be a string")
        return cls(status, reward, reason)
