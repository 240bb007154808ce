"""Reward registry: a reward is a pure `(completion, answer) -> RewardOutput` function added with @reward.

A leaf: reward modules (the built-in ones and users') import it. Look rewards up with
`jetroll.functions.runner.get_reward`, which loads the built-ins first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["REWARDS", "RewardFn", "RewardOutput", "reward"]


@dataclass(frozen=True, slots=True)
class RewardOutput:
    """What a reward function returns: a reward in [0, 1], whether the completion is exactly right, and a short
    human-readable note on why (e.g. which code test failed), empty when there is nothing to add."""

    reward: float
    correct: bool
    details: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1], got {self.reward}")


RewardFn = Callable[[str, str], RewardOutput]

REWARDS: dict[str, RewardFn] = {}


def reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register the decorated function as the reward called `name`."""

    def register(fn: RewardFn) -> RewardFn:
        existing = REWARDS.get(name)
        if existing is not None and existing is not fn:
            where = f"{existing.__module__}.{existing.__name__}"
            raise ValueError(f"reward {name!r} is already registered ({where})")
        REWARDS[name] = fn
        return fn

    return register
