"""Built-in rewards: exact, partial credit, garbage (0, never an exception), and the registry."""

from __future__ import annotations

import pytest

from functions.registry import REWARDS, RewardOutput, get_reward, reward
from functions.rewards import arithmetic_reward, count_reward


def test_arithmetic_exact() -> None:
    assert arithmetic_reward(" 579\n", "579") == RewardOutput(1.0, True)
    assert arithmetic_reward("-855", "-855") == RewardOutput(1.0, True)


def test_arithmetic_partial() -> None:
    assert arithmetic_reward("574", "579") == RewardOutput(0.5 * 2 / 3, False)
    assert arithmetic_reward("855", "-855") == RewardOutput(0.5 * 3 / 4, False)  # sign is a character
    assert arithmetic_reward("10579", "579") == RewardOutput(0.5 * 3 / 5, False)  # extra digits cost
    assert arithmetic_reward("123", "579") == RewardOutput(0.0, False)


GARBAGE = ["", "   ", "abc", "57 9", "5-79", "--1", "1.0", "\x00\x01", "9" * 10_000]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_arithmetic_garbage_scores_low_without_error(garbage: str) -> None:
    out = arithmetic_reward(garbage, "579")
    assert not out.correct and 0.0 <= out.reward < 0.5
    if not garbage.strip().lstrip("-").isdigit():
        assert out.reward == 0.0


def test_count() -> None:
    answer = "140 143 146 149"
    assert count_reward(answer + "\n", answer) == RewardOutput(1.0, True)
    assert count_reward("140 143 147 149", answer) == RewardOutput(0.5, False)  # prefix credit only
    assert count_reward("140 143", answer) == RewardOutput(0.5, False)
    assert count_reward("140 143 146 149 152 155", answer) == RewardOutput(4 / 6, False)
    assert count_reward("140  143 146 149", answer) == RewardOutput(1 / 5, False)  # "" item breaks it
    assert count_reward("zzz", answer) == RewardOutput(0.0, False)
    assert count_reward("", answer) == RewardOutput(0.0, False)


def test_registry() -> None:
    assert get_reward("arithmetic") is arithmetic_reward and get_reward("count") is count_reward
    with pytest.raises(ValueError, match=r"unknown reward 'nope'; valid: \["):
        get_reward("nope")

    @reward("test_registry_tmp")
    def tmp(completion: str, answer: str) -> RewardOutput:
        return RewardOutput(0.0, False)

    try:
        assert get_reward("test_registry_tmp") is tmp
        with pytest.raises(ValueError, match="already registered"):
            reward("test_registry_tmp")(arithmetic_reward)
    finally:
        del REWARDS["test_registry_tmp"]


def test_reward_output_bounds() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        RewardOutput(1.5, True)
