"""Built-in reward functions. Pure: no I/O, no Redis, no torch. Garbage output scores 0, never raises."""

from __future__ import annotations

import re

from functions.registry import RewardOutput, reward

_INTEGER = re.compile(r"-?\d+")


@reward("arithmetic")
def arithmetic_reward(completion: str, answer: str) -> RewardOutput:
    """1.0 for the exact integer; else 0.5 x the fraction of right-aligned characters that match (sign too).

    The fraction's denominator is the longer of the two strings, so padding with extra digits does not pay.
    Anything that is not an integer scores 0.
    """
    got, want = completion.strip(), answer.strip()
    if got == want:
        return RewardOutput(reward=1.0, correct=True)
    if not _INTEGER.fullmatch(got):
        return RewardOutput(reward=0.0, correct=False)
    matches = sum(g == w for g, w in zip(reversed(got), reversed(want), strict=False))
    return RewardOutput(reward=0.5 * matches / max(len(got), len(want)), correct=False)


@reward("count")
def count_reward(completion: str, answer: str) -> RewardOutput:
    """The fraction of expected numbers produced correctly in order from the start (prefix credit).

    Items are split on single spaces, so the reward is 1.0 exactly when the stripped text matches; numbers
    produced past the expected ones count against the denominator.
    """
    got, want = completion.strip().split(" "), answer.strip().split(" ")
    prefix = 0
    for g, w in zip(got, want, strict=False):
        if g != w:
            break
        prefix += 1
    correct = got == want
    return RewardOutput(reward=1.0 if correct else prefix / max(len(got), len(want)), correct=correct)
