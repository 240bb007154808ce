"""The JSON call shared by the Celery task and the Lambda handler: run a registered reward by name.

Request: {"reward": name, "completion": str, "answer": str, ...}; reply: {"reward": float, "correct": bool,
"details": str}.
Extra reward modules (user rewards registered with @reward) come from `JETROLL_REWARD_MODULES`, comma-separated.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import jetroll.functions.builtin  # noqa: F401  (the built-in rewards register themselves on import)
from jetroll.functions.registry import REWARDS, RewardFn, RewardOutput

MODULES_ENV = "JETROLL_REWARD_MODULES"
# Reward modules written before the package moved under `jetroll` import these names; they resolve, with a warning,
# for one release.
LEGACY_NAMES = {"functions": "jetroll.functions", "functions.registry": "jetroll.functions.registry"}


def get_reward(name: str) -> RewardFn:
    """The reward function called `name`; ValueError listing the valid names otherwise."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)}") from None


class _LegacyNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `functions.registry` as `jetroll.functions.registry` (the same module object) and says so."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in LEGACY_NAMES:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname == "functions")

    def create_module(self, spec: Any) -> ModuleType:
        new = LEGACY_NAMES[spec.name]
        warnings.warn(f"`{spec.name}` is now `{new}`; the old name goes in the next release", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module is already executed under its new name


def import_reward_modules(spec: str | None = None) -> list[str]:
    """Import the comma-separated modules in `spec` (default: $JETROLL_REWARD_MODULES) so their rewards register."""
    spec = os.environ.get(MODULES_ENV, "") if spec is None else spec
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if names and not any(isinstance(finder, _LegacyNames) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LegacyNames())  # ahead of a checkout on sys.path, whose functions/ is a copy
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
