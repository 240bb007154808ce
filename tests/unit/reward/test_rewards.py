"""Built-in rewards (all but `code`, tested with the sandbox): exact, partial credit, garbage (0, never an
exception), bad answers (an error), and the registry."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from jetroll.functions.builtin import (
    arithmetic_reward,
    calculator_reward,
    count_reward,
    exact_match_reward,
    format_reward,
    length_reward,
    math_reward,
    token_f1_reward,
)
from jetroll.functions.registry import REWARDS, RewardOutput, reward
from jetroll.functions.runner import get_reward


def test_arithmetic_exact() -> None:
    assert arithmetic_reward(" 579\n", "579") == RewardOutput(1.0, True)
    assert arithmetic_reward("-855", "-855") == RewardOutput(1.0, True)


def test_arithmetic_partial() -> None:
    assert arithmetic_reward("574", "579") == RewardOutput(0.5 * 2 / 3, False)
    assert arithmetic_reward("-815", "-855") == RewardOutput(0.5 * 3 / 4, False)  # the sign is a character
    assert arithmetic_reward("123", "579") == RewardOutput(0.0, False)


@pytest.mark.parametrize(("completion", "answer"), [("047", "1047"), ("1579", "579"), ("855", "-855"), ("-96", "96")])
def test_arithmetic_wrong_length_earns_nothing(completion: str, answer: str) -> None:
    """A dropped or extra leading digit or sign scores 0, whatever digits it gets right."""
    assert arithmetic_reward(completion, answer) == RewardOutput(0.0, False)


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


def test_calculator_scores_the_final_turn_only() -> None:
    assert calculator_reward("call 347*829\n= 287663\n287663", "287663") == RewardOutput(1.0, True)
    assert calculator_reward("287663", "287663") == RewardOutput(1.0, True)  # no tool, right anyway
    assert calculator_reward("287663\n", "287663") == RewardOutput(1.0, True)  # a final turn ended by the turn end
    assert calculator_reward("call 347*829\n= 287663\n", "287663") == RewardOutput(0.0, False)  # cut off
    assert calculator_reward("call 347*829\n= 287663\n287662", "287663") == RewardOutput(0.0, False)
    assert calculator_reward("287663\ncall 1*2\n= 2\n2", "287663") == RewardOutput(0.0, False)
    for garbage in GARBAGE:
        assert calculator_reward(garbage, "287663") == RewardOutput(0.0, False)


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


MATH_EQUIVALENT = [
    (r"The answer is $\boxed{0.5}$.", r"\frac{1}{2}"),
    ("So it is 1/2", "0.5"),
    (r"$\frac{2}{4}$", r"$\frac{1}{2}$"),
    (r"Therefore \boxed{\sqrt{2}}", r"\sqrt{2}"),
    (r"$x^2 + 1$", "1 + x^2"),
    (r"\boxed{42}", r"\boxed{42}"),
]


@pytest.mark.parametrize(("completion", "answer"), MATH_EQUIVALENT)
def test_math_equivalent_answers(completion: str, answer: str) -> None:
    assert math_reward(completion, answer) == RewardOutput(1.0, True)


def test_math_wrong_answer() -> None:
    assert math_reward(r"The answer is $\boxed{3}$", "4") == RewardOutput(0.0, False)
    assert math_reward(r"$\frac{1}{3}$", "0.5") == RewardOutput(0.0, False)


@pytest.mark.parametrize("garbage", GARBAGE + [r"\boxed{", "}}}{{{ $$ \\frac{", "\ud800", "no numbers here"])
def test_math_garbage_scores_zero_without_error(garbage: str) -> None:
    out = math_reward(garbage, r"\frac{1}{2}")
    assert (out.reward, out.correct) == (0.0, False)


def test_math_unparsable_answer_raises() -> None:
    with pytest.raises(ValueError, match="cannot be parsed"):
        math_reward("1", "")


def test_math_off_the_main_thread() -> None:
    # math-verify's signal-based timeout only works in the main thread; elsewhere it must still score.
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_reward, r"$\boxed{0.5}$", r"\frac{1}{2}").result() == RewardOutput(1.0, True)


def test_exact_match() -> None:
    assert exact_match_reward("  Paris\n", "Paris") == RewardOutput(1.0, True)
    assert exact_match_reward("paris", "Paris") == RewardOutput(0.0, False)


def test_token_f1() -> None:
    assert token_f1_reward("The Eiffel Tower!", "eiffel tower") == RewardOutput(1.0, True)
    assert token_f1_reward("Eiffel", "the Eiffel Tower") == RewardOutput(2 / 3, False)  # precision 1, recall 1/2
    assert token_f1_reward("tower eiffel", "Eiffel Tower") == RewardOutput(1.0, False)  # same tokens, wrong order
    assert token_f1_reward("Paris", "London") == RewardOutput(0.0, False)
    assert token_f1_reward("", "London") == RewardOutput(0.0, False)
    assert token_f1_reward("\x00 ???", "London") == RewardOutput(0.0, False)


def test_format() -> None:
    think = r"<think>.*</think>\s*<answer>.*</answer>"
    assert format_reward("<think>hmm\n2+2</think>\n<answer>4</answer>\n", think) == RewardOutput(1.0, True)
    assert format_reward("<answer>4</answer>", think) == RewardOutput(0.0, False)
    assert format_reward("", think) == RewardOutput(0.0, False)


def test_length() -> None:
    assert length_reward(" hello \n", '{"max_chars": 5}') == RewardOutput(1.0, True, "5 chars")
    assert length_reward("hello!", {"max_chars": 5}) == RewardOutput(0.0, False, "6 chars")  # a decoded dict too
    assert length_reward("hi", {"min_chars": 3, "max_chars": 5}).reward == 0.0
    with pytest.raises(ValueError, match="min_chars <= max_chars"):
        length_reward("hi", {"min_chars": 6, "max_chars": 5})
    with pytest.raises(msgspec.ValidationError, match="max_chars"):
        length_reward("hi", "{}")


def test_builtin_rewards_are_registered() -> None:
    names = {"arithmetic", "count", "math", "code", "exact_match", "token_f1", "format", "length"}
    assert names <= set(REWARDS)
    assert RewardOutput(1.0, True).details == ""


def test_a_reward_module_on_the_old_import_name_still_loads_with_a_warning() -> None:
    """One release of grace: `from functions.registry import reward` is the registry itself, and says it moved."""
    import sys

    import jetroll.functions.registry as registry
    from jetroll.functions.runner import call_reward, import_reward_modules

    with pytest.warns(DeprecationWarning, match="`functions.registry` is now `jetroll.functions.registry`"):
        import_reward_modules("legacy_reward_fns")
    try:
        assert sys.modules["functions.registry"] is registry
        assert call_reward({"reward": "test_legacy", "completion": "7", "answer": "7"})["reward"] == 1.0
    finally:
        del REWARDS["test_legacy"]
        for name in ("legacy_reward_fns", "functions.registry", "functions"):
            sys.modules.pop(name, None)
