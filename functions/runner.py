"""The JSON call shared by the Celery task and the Lambda handler: run a registered reward by name.

Request: {"reward": name, "completion": str, "answer": str, ...}; reply: {"reward": float, "correct": bool,
"details": str}.
Extra reward modules (user rewards registered with @reward) come from `JETROLL_REWARD_MODULES`, comma-separated.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Mapping
from typing import Any

from functions.registry import RewardOutput, get_reward

MODULES_ENV = "JETROLL_REWARD_MODULES"


def import_reward_modules(spec: str | None = None) -> list[str]:
    """Import the comma-separated modules in `spec` (default: $JETROLL_REWARD_MODULES) so their rewards register."""
    spec = os.environ.get(MODULES_ENV, "") if spec is None else spec
    names = [name.strip() for name in spec.split(",") if name.strip()]
    for name in names:
        importlib.import_module(name)
    return names


def call_reward(request: Mapping[str, Any]) -> dict[str, Any]:
    """Run `request["reward"]`; raises ValueError/TypeError for a bad request or a bad reward output."""
    for field in ("reward", "completion", "answer"):
        if not isinstance(request.get(field), str):
            raise ValueError(f"reward request needs a string {field!r}, got {type(request.get(field)).__name__}")
    name = request["reward"]
    out = get_reward(name)(request["completion"], request["answer"])
    if not isinstance(out, RewardOutput):
        raise TypeError(f"reward {name!r} returned {type(out).__name__}, not RewardOutput")
    if not math.isfinite(out.reward):
        raise ValueError(f"reward {name!r} returned a non-finite reward {out.reward}")
    return {"reward": float(out.reward), "correct": bool(out.correct), "details": str(out.details)}
