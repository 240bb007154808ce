"""A user's reward module written before the package moved under `jetroll`: it imports the old name."""

from __future__ import annotations

from functions.registry import RewardOutput, reward


@reward("test_legacy")
def legacy_reward(completion: str, answer: str) -> RewardOutput:
    return RewardOutput(reward=float(completion == answer), correct=completion == answer)
