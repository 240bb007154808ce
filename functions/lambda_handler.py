"""AWS Lambda runner: `handler(event, context)` runs the registered reward `event["reward"]`, JSON in and out.

Event: {"reward": name, "completion": str, "answer": str, "traj_id": str}; result: {"reward": float, "correct": bool,
"details": str}.
A failing reward raises, so Lambda reports it as a function error (`X-Amz-Function-Error: Unhandled`), never as a
score. Set JETROLL_REWARD_MODULES on the function to load user rewards at cold start.
"""

from __future__ import annotations

from typing import Any

from jetroll.functions.runner import call_reward, import_reward_modules

import_reward_modules()


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Lambda entry point; `context` is unused (the function timeout is Lambda's to enforce)."""
    if not isinstance(event, dict):
        raise ValueError(f"the event must be a JSON object, got {type(event).__name__}")
    return call_reward(event)
