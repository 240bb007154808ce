"""The long-output task: count on from a 4-digit start."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from jetroll.shared.tasks.base import DrawnTask, Problem


@dataclass(frozen=True)
class CountTask(DrawnTask):
    """The long-output task: `count 1234 by 7:` -> the next `length` numbers, space separated.

    Starts are 4-digit and stay 4-digit through the last term, so every answer is exactly
    `5 * length - 1` characters (639 for 128 numbers): always at least 512 generated tokens.
    """

    splits_seed: ClassVar[str] = "count"
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
