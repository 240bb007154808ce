"""The default task: 3-digit addition and subtraction, scored by exact match."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from jetroll.shared.tasks.base import DrawnTask, Problem, training_problem


@dataclass(frozen=True)
class ArithmeticTask(DrawnTask):
    """`a+b=` / `a-b=` with operands 0..999; the answer is the exact integer (may be negative)."""

    splits_seed: ClassVar[str] = "arithmetic"
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

    def sft_sample(self, rng: random.Random) -> Problem:
        # operand lengths drawn uniformly: the short problems teach the digit-wise algorithm, which a
        # from-scratch model otherwise finds only after a long plateau on uniform 3-digit operands
        return training_problem(rng, self._draw_digit_balanced, self.key, self.make)
