"""The multi-turn task: 3-digit products, with a calculator tool the model may call."""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import ClassVar

from jetroll.shared.tasks.base import DrawnTask, Problem
from jetroll.shared.tasks.env import EnvStep


@dataclass(frozen=True)
class CalculatorTask(DrawnTask):
    """The multi-turn task: `347*829=` with 3-digit operands, answered with the exact product.

    The model may call the calculator: a turn `call 347*829` plus the turn end gets the observation `= 287663`
    plus the turn end, and the model's next turn is its final answer. A product of two 3-digit numbers is beyond
    the tiny model without the tool, so success is about the rate of correct tool use. The warm start's teacher
    calls the tool on `tool_rate_low` of the problems whose first operand is below `low_below` and `tool_rate`
    of the rest (it answers the others directly, with the exact product), so the base model uses the tool on
    some problems only and RL has room to learn to use it always.
    """

    splits_seed: ClassVar[str] = "calculator"
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


_CALL = re.compile(r"call (\d{1,4})([*+-])(\d{1,4})")


class CalculatorEnv:
    """The calculator tool: a turn `call <a><op><b>` (op one of * + -, operands up to 4 digits) is answered with
    the observation `= <result>` and the turn end; any other turn is the final answer and ends the episode, as
    does a turn after `max_calls` calls. The final step's reward is 1.0 iff it states the problem's answer."""

    def __init__(self, turn_end: str = "\n", max_calls: int = 2) -> None:
        self.turn_end = turn_end
        self.max_calls = max_calls
        self.answer: str | None = None
        self.num_calls = 0

    async def reset(self, problem: Problem) -> None:
        self.answer = problem.answer
        self.num_calls = 0

    async def step(self, turn: str) -> EnvStep:
        assert self.answer is not None, "step before reset"
        call = _CALL.fullmatch(turn.strip())
        if call is None or self.num_calls >= self.max_calls:
            return EnvStep(done=True, reward=float(turn.strip() == self.answer))
        self.num_calls += 1
        a, op, b = int(call[1]), call[2], int(call[3])
        result = a * b if op == "*" else a + b if op == "+" else a - b
        return EnvStep(observation=f"= {result}{self.turn_end}")
