"""Built-in reward functions. Pure: no Redis, no torch, no state between calls (only `code` runs a process, in
the sandbox). Garbage model output scores 0 and never raises; a malformed `answer` raises (bad data)."""

from __future__ import annotations

import re
import string
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from jetroll.functions.registry import RewardOutput, reward
from jetroll.functions.sandbox import SandboxResult, run_python

_SpecT = TypeVar("_SpecT", bound=msgspec.Struct)

_INTEGER = re.compile(r"-?\d+")


@reward("arithmetic")
def arithmetic_reward(completion: str, answer: str) -> RewardOutput:
    """1.0 for the exact integer; else, for an integer of the right length, 0.5 x the fraction of its characters
    that match (the sign too). Anything else scores 0: a dropped or extra leading digit or sign earns nothing.

    Crediting the right-aligned digits of a shorter answer made dropping the leading 1 of a carry into a new digit
    (`159+888=` answered `047`) a cheap local optimum: one default run fell into it and lost 20 points of held-out
    accuracy in 20 steps.
    """
    got, want = completion.strip(), answer.strip()
    if got == want:
        return RewardOutput(reward=1.0, correct=True)
    if not _INTEGER.fullmatch(got) or len(got) != len(want):
        return RewardOutput(reward=0.0, correct=False)
    matches = sum(g == w for g, w in zip(got, want, strict=True))
    return RewardOutput(reward=0.5 * matches / len(want), correct=False)


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


@reward("calculator")
def calculator_reward(completion: str, answer: str) -> RewardOutput:
    """1.0 iff the model's final turn is exactly the integer `answer`, else 0.

    The completion is the whole multi-turn transcript: tool calls, the calculator's `= <result>` observations and
    the final answer, turns separated by newlines. The final turn is the last line once trailing newlines are
    stripped, so an episode cut off after an observation (which starts with `=`) never scores.
    """
    final = completion.rstrip("\n").rpartition("\n")[2].strip()
    correct = final == answer.strip()
    return RewardOutput(reward=float(correct), correct=correct)


# rewards that replay an environment or a dataset through jetroll.shared and an optional extra: they run on the local,
# inline and Celery backends (the job's image), not from rewards.zip (scripts/build_lambda_zips.py), which holds
# functions/ alone
NOT_ON_LAMBDA = frozenset({"gymnasium", "reasoning_gym"})


@reward("gymnasium")
def gymnasium_reward(completion: str, answer: str) -> RewardOutput:
    """The environment's own reward for a `kind: gymnasium` episode: its transcript (model turns and observations,
    one line each) replayed through the same gymnasium environment the episode ran on. An episode that never ended
    (cut off by its token budget) scores 0."""
    from jetroll.shared.tasks.gym_text import GymProblem  # gymnasium: only its tasks pay for the import

    value, ended = GymProblem.parse(answer).replay(completion)
    return RewardOutput(reward=value, correct=ended and value > 0)


@reward("reasoning_gym")
def reasoning_gym_reward(completion: str, answer: str) -> RewardOutput:
    """A `kind: reasoning_gym` entry's own `score_answer` of the completion (stripped): 1.0 for an exact answer,
    partial credit where the dataset gives it."""
    from jetroll.shared.tasks.reasoning import EntryRef  # reasoning-gym: only its tasks pay for the import

    score = EntryRef.parse(answer).score(completion)
    return RewardOutput(reward=score, correct=score == 1.0)


@reward("math")
def math_reward(completion: str, answer: str) -> RewardOutput:
    """1.0 iff math-verify finds the completion's final answer equal to `answer` (so `\\frac{1}{2}` equals `0.5`).

    `answer` is LaTeX or a plain expression, with or without `$...$` or `\\boxed{}`. A completion without a
    parsable answer scores 0; an `answer` that cannot be parsed raises ValueError (bad data, not a wrong model).
    """
    from math_verify import parse, verify  # imports sympy (~0.5 s): only math tasks pay for it

    # math-verify bounds its sympy work with signal.alarm, which only the main thread may set; in another
    # thread the caller's own timeout (the reward pool's) must bound it.
    timeout_s = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"math answer {answer!r} cannot be parsed")
    pred = parse(completion, parsing_timeout=timeout_s)  # never raises: unparsable text gives []
    correct = verify(gold, pred, timeout_seconds=timeout_s)
    return RewardOutput(reward=float(correct), correct=correct, details="" if pred else "no answer found")


@reward("exact_match")
def exact_match_reward(completion: str, answer: str) -> RewardOutput:
    """1.0 iff the completion equals `answer`, ignoring surrounding whitespace."""
    correct = completion.strip() == answer.strip()
    return RewardOutput(reward=float(correct), correct=correct)


_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _answer_tokens(text: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, split on whitespace."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


@reward("token_f1")
def token_f1_reward(completion: str, answer: str) -> RewardOutput:
    """Partial match: the F1 of the normalised tokens shared with `answer` (SQuAD's metric); correct iff equal."""
    got, want = _answer_tokens(completion), _answer_tokens(answer)
    correct = got == want
    overlap = sum((Counter(got) & Counter(want)).values())
    if correct or overlap == 0:
        return RewardOutput(reward=float(correct), correct=correct)
    precision, recall = overlap / len(got), overlap / len(want)
    return RewardOutput(reward=2 * precision * recall / (precision + recall), correct=False)


@reward("format")
def format_reward(completion: str, answer: str) -> RewardOutput:
    """1.0 iff the stripped completion fully matches the regular expression `answer`, with `.` matching newlines,
    e.g. `<think>.*</think>\\s*<answer>.*</answer>`."""
    correct = re.fullmatch(answer, completion.strip(), flags=re.DOTALL) is not None
    return RewardOutput(reward=float(correct), correct=correct)


class LengthSpec(msgspec.Struct, forbid_unknown_fields=True):
    """The `answer` of the `length` reward, as JSON: bounds on the stripped completion's length in characters."""

    max_chars: int
    min_chars: int = 0


@reward("length")
def length_reward(completion: str, answer: str | Mapping[str, Any]) -> RewardOutput:
    """1.0 iff the stripped completion has between `min_chars` and `max_chars` characters, e.g. `{"max_chars": 400}`."""
    spec = _decode_spec(answer, LengthSpec)
    if not 0 <= spec.min_chars <= spec.max_chars:
        raise ValueError(f"length answer needs 0 <= min_chars <= max_chars, got {spec.min_chars}, {spec.max_chars}")
    num_chars = len(completion.strip())
    correct = spec.min_chars <= num_chars <= spec.max_chars
    return RewardOutput(reward=float(correct), correct=correct, details=f"{num_chars} chars")


class StdioCase(msgspec.Struct, forbid_unknown_fields=True):
    """One run of the program: it reads `stdin` and must print `stdout` (trailing whitespace per line ignored)."""

    stdin: str
    stdout: str


class CodeTests(msgspec.Struct, forbid_unknown_fields=True):
    """The `answer` of the `code` reward, as JSON: stdin/stdout cases and/or assert statements appended to the
    code, e.g. `{"asserts": ["assert add(1, 2) == 3"]}`. Each case or assert is one sandboxed run."""

    stdio: list[StdioCase] = []
    asserts: list[str] = []


_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


@reward("code")
def code_reward(completion: str, answer: str | Mapping[str, Any]) -> RewardOutput:
    """1.0 iff the completion's last ```python block (else its whole text) passes every test of `answer`.

    Each test runs in `jetroll.functions.sandbox` with its default limits, and the first failure ends scoring (binary
    reward, so a bad program costs one run, not one per test). A program that crashes, hangs or hits a limit
    fails its test; only a sandbox that cannot run at all raises.
    """
    tests = _decode_spec(answer, CodeTests)
    if not tests.stdio and not tests.asserts:
        raise ValueError("code answer has no tests: give `stdio` cases and/or `asserts`")
    blocks = _CODE_BLOCK.findall(completion)
    code = blocks[-1] if blocks else completion
    runs = [(code, case.stdin, case.stdout) for case in tests.stdio]
    runs += [(f"{code}\n\n{assertion}\n", "", None) for assertion in tests.asserts]
    for i, (source, stdin, want_stdout) in enumerate(runs, start=1):
        failure = _test_failure(run_python(source, stdin), want_stdout)
        if failure:
            return RewardOutput(reward=0.0, correct=False, details=f"test {i}/{len(runs)} failed: {failure}")
    return RewardOutput(reward=1.0, correct=True, details=f"passed {len(runs)} tests")


def _test_failure(result: SandboxResult, want_stdout: str | None) -> str:
    """Why a sandboxed test failed, or "" if it passed."""
    if result.killed_by_limit is not None:
        return f"hit the {result.killed_by_limit} limit"
    if result.exit_code != 0:
        last_line = result.stderr.rstrip().rpartition("\n")[2]
        return f"exit code {result.exit_code}: {last_line[:200]}"
    if want_stdout is not None and _output_lines(result.stdout) != _output_lines(want_stdout):
        return "wrong output"
    return ""


def _output_lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _decode_spec(answer: str | Mapping[str, Any], spec: type[_SpecT]) -> _SpecT:
    """A reward's answer spec from its JSON text, or from a dict already decoded (a Celery or Lambda payload)."""
    if isinstance(answer, str):
        return msgspec.json.decode(answer, type=spec)
    return msgspec.convert(answer, spec)
