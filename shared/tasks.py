"""Tasks: problem generators with a reward name and a held-out split that is disjoint by construction.

Every prompt and answer uses only the char-level vocabulary:
`0-9 + - = * / : ; , . ? ! ( ) [ ] space a-z newline`.
A problem's split (train, probe or held-out) is a pure function of its parameters (a hash), so `sample` can never
return a held-out or probe problem and neither set needs to remember what training saw. The probe set is the warm
start's: it stops the supervised pass, so it must not be the held-out set RL is scored on.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from shared.env import CalculatorEnv

HELDOUT_PERCENT = 10
PROBE_PERCENT = 2
Split = Literal["train", "probe", "heldout"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem: the prompt the model continues and the exact expected completion."""

    prompt: str
    answer: str


@runtime_checkable
class Task(Protocol):
    """A task users register: how to draw problems and which reward function scores them."""

    name: str
    reward: str  # name of its reward function in functions.registry
    max_new_tokens: int  # generation budget the controller asks rollout for (capped by rollout.max_new_tokens)

    def sample(self, rng: random.Random) -> Problem:
        """A training problem (never a held-out one)."""
        ...

    def heldout(self, n: int) -> list[Problem]:
        """A deterministic held-out set of n problems, disjoint from training by construction."""
        ...

    def probe(self, n: int) -> list[Problem]:
        """A deterministic probe set of n problems for the warm start, disjoint from training and held-out sets."""
        ...

    def sft_sample(self, rng: random.Random) -> Problem:
        """A problem for the supervised warm start: training split only, may follow a curriculum."""
        ...

    def sft_completion(self, problem: Problem) -> str:
        """The target completion text for the supervised warm start (without EOS)."""
        ...


def split_of(key: str) -> Split:
    """Deterministic split, independent of any RNG: about HELDOUT_PERCENT % of problem keys are held out and
    PROBE_PERCENT % probe the warm start; the rest train."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % 100
    if bucket < HELDOUT_PERCENT:
        return "heldout"
    return "probe" if bucket < HELDOUT_PERCENT + PROBE_PERCENT else "train"


def _training_problem(
    rng: random.Random, draw: Callable[[random.Random], tuple[Any, ...]], key: Callable[..., str],
    make: Callable[..., Problem],
) -> Problem:
    """Draw parameter tuples until one is in the training split."""
    while True:
        params = draw(rng)
        if split_of(key(*params)) == "train":
            return make(*params)


def _split_problems(
    n: int,
    split: Split,
    draw: Callable[[random.Random], tuple[Any, ...]],
    key: Callable[..., str],
    make: Callable[..., Problem],
    seed: str,
    max_draws: int,
) -> list[Problem]:
    """Draw parameter tuples from a fixed-seed RNG, keep distinct ones of `split` until there are n."""
    if n < 0:
        raise ValueError(f"{split}(n) needs n >= 0, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[Problem] = []
    for _ in range(max_draws):
        if len(problems) == n:
            return problems
        params = draw(rng)
        k = key(*params)
        if k in seen or split_of(k) != split:
            continue
        seen.add(k)
        problems.append(make(*params))
    if len(problems) < n:
        raise ValueError(f"asked for {n} {split} problems; found {len(problems)} within the draw budget")
    return problems


@dataclass(frozen=True)
class ArithmeticTask:
    """`a+b=` / `a-b=` with operands 0..999; the answer is the exact integer (may be negative)."""

    name: str = "arithmetic"
    reward: str = "arithmetic"
    max_new_tokens: int = 8
    max_operand: int = 999

    @staticmethod
    def key(a: int, op: str, b: int) -> str:
        return f"arithmetic:{a}{op}{b}"

    @staticmethod
    def make(a: int, op: str, b: int) -> Problem:
        return Problem(prompt=f"{a}{op}{b}=", answer=str(a + b if op == "+" else a - b))

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        return rng.randint(0, self.max_operand), rng.choice("+-"), rng.randint(0, self.max_operand)

    def _draw_digit_balanced(self, rng: random.Random) -> tuple[int, str, int]:
        def operand() -> int:
            digits = rng.randint(1, len(str(self.max_operand)))
            return rng.randint(0 if digits == 1 else 10 ** (digits - 1), min(10**digits - 1, self.max_operand))

        return operand(), rng.choice("+-"), operand()

    def sample(self, rng: random.Random) -> Problem:
        return _training_problem(rng, self._draw, self.key, self.make)

    def sft_sample(self, rng: random.Random) -> Problem:
        # operand lengths drawn uniformly: the short problems teach the digit-wise algorithm, which a
        # from-scratch model otherwise finds only after a long plateau on uniform 3-digit operands
        return _training_problem(rng, self._draw_digit_balanced, self.key, self.make)

    def heldout(self, n: int) -> list[Problem]:
        return _split_problems(n, "heldout", self._draw, self.key, self.make, "arithmetic-heldout", 100 * n + 10_000)

    def probe(self, n: int) -> list[Problem]:
        return _split_problems(n, "probe", self._draw, self.key, self.make, "arithmetic-probe", 500 * n + 10_000)

    def sft_completion(self, problem: Problem) -> str:
        return problem.answer


@dataclass(frozen=True)
class CountTask:
    """The long-output task: `count 1234 by 7:` -> the next `length` numbers, space separated.

    Starts are 4-digit and stay 4-digit through the last term, so every answer is exactly
    `5 * length - 1` characters (639 for 128 numbers): always at least 512 generated tokens.
    """

    name: str = "count"
    reward: str = "count"
    length: int = 128
    min_start: int = 1000
    max_start: int = 8000
    max_step: int = 9

    def __post_init__(self) -> None:
        if self.max_start + self.length * self.max_step > 9999 or self.min_start < 1000:
            raise ValueError("count task terms must stay 4-digit: need min_start >= 1000 and "
                             "max_start + length * max_step <= 9999")

    @property
    def answer_chars(self) -> int:
        return 5 * self.length - 1

    @property
    def max_new_tokens(self) -> int:
        return self.answer_chars + 16

    @staticmethod
    def key(start: int, step: int) -> str:
        return f"count:{start}:{step}"

    def make(self, start: int, step: int) -> Problem:
        terms = (str(start + step * i) for i in range(1, self.length + 1))
        return Problem(prompt=f"count {start} by {step}:", answer=" ".join(terms))

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(self.min_start, self.max_start), rng.randint(1, self.max_step)

    def sample(self, rng: random.Random) -> Problem:
        return _training_problem(rng, self._draw, self.key, self.make)

    def heldout(self, n: int) -> list[Problem]:
        return _split_problems(n, "heldout", self._draw, self.key, self.make, "count-heldout", 100 * n + 10_000)

    def probe(self, n: int) -> list[Problem]:
        return _split_problems(n, "probe", self._draw, self.key, self.make, "count-probe", 500 * n + 10_000)

    def sft_sample(self, rng: random.Random) -> Problem:
        return self.sample(rng)

    def sft_completion(self, problem: Problem) -> str:
        return problem.answer


@dataclass(frozen=True)
class CalculatorTask:
    """The multi-turn task: `347*829=` with 3-digit operands, answered with the exact product.

    The model may call the calculator: a turn `call 347*829` plus the turn end gets the observation `= 287663`
    plus the turn end, and the model's next turn is its final answer. A product of two 3-digit numbers is beyond
    the tiny model without the tool, so success is about the rate of correct tool use. The warm start's teacher
    calls the tool on `tool_rate_low` of the problems whose first operand is below `low_below` and `tool_rate`
    of the rest (it answers the others directly, with the exact product), so the base model uses the tool on
    some problems only and RL has room to learn to use it always.
    """

    name: str = "calculator"
    reward: str = "calculator"
    max_new_tokens: int = 40  # completion budget, observations included: a call (13) + its result (9) + answer
    turn_end: str = "\n"
    max_calls: int = 2
    min_operand: int = 100
    max_operand: int = 999
    low_below: int = 400
    tool_rate_low: float = 0.7
    tool_rate: float = 0.1

    @staticmethod
    def key(a: int, b: int) -> str:
        return f"calculator:{a}*{b}"

    @staticmethod
    def make(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}*{b}=", answer=str(a * b))

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(self.min_operand, self.max_operand), rng.randint(self.min_operand, self.max_operand)

    def sample(self, rng: random.Random) -> Problem:
        return _training_problem(rng, self._draw, self.key, self.make)

    def heldout(self, n: int) -> list[Problem]:
        return _split_problems(n, "heldout", self._draw, self.key, self.make, "calculator-heldout", 100 * n + 10_000)

    def probe(self, n: int) -> list[Problem]:
        return _split_problems(n, "probe", self._draw, self.key, self.make, "calculator-probe", 500 * n + 10_000)

    def sft_sample(self, rng: random.Random) -> Problem:
        return self.sample(rng)

    def sft_turns(self, problem: Problem) -> list[tuple[str, str]]:
        # the teacher's choice is a pure function of the problem, so the warm start stays a function of its seed
        a = int(problem.prompt.split("*")[0])
        digest = hashlib.sha256(f"calculator-teacher:{problem.prompt}".encode()).digest()
        rate = self.tool_rate_low if a < self.low_below else self.tool_rate
        if int.from_bytes(digest[:8], "little") / 2**64 >= rate:
            return [(problem.answer, "")]
        expression = problem.prompt.removesuffix("=")
        return [(f"call {expression}", f"= {problem.answer}{self.turn_end}"), (problem.answer, "")]

    def sft_completion(self, problem: Problem) -> str:
        turns = self.sft_turns(problem)
        return "".join(turn + (self.turn_end + obs if obs else "") for turn, obs in turns)

    def make_env(self) -> CalculatorEnv:
        return CalculatorEnv(self.turn_end, self.max_calls)


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add a task to TASKS under `task.name`; a different task already holding that name is an error."""
    existing = TASKS.get(task.name)
    if existing is not None and existing != task:
        raise ValueError(f"task {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The registered task called `name`; ValueError listing the valid names otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid: {sorted(TASKS)}") from None


register_task(ArithmeticTask())
register_task(CountTask())
# a mid-length variant (159-character answers) that RL runs on 2 cores can afford: `bench precision` uses it
register_task(CountTask(name="count32", length=32))
register_task(CalculatorTask())
