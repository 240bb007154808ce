"""Your own gymnasium environment in a jetroll job: a number-guessing game and its text adapter.

The job names both by import path (run it from the repository root, where `examples` imports):

    tasks:
      - kind: gymnasium
        name: guess
        env_id: examples.guess_number:GuessNumber-v0   # gymnasium imports the module, which registers the env
        adapter: examples.guess_number:GuessText        # how the model reads and plays it
        max_turns: 10
        max_new_tokens: 96
"""

from __future__ import annotations

import random
from typing import Any

import gymnasium
from gymnasium import spaces


class GuessNumber(gymnasium.Env):
    """Guess a secret number in [0, 999]: each guess is told `higher` or `lower`; reward 1 on the number."""

    def __init__(self, secret: int = 0) -> None:
        self.secret = secret
        self.action_space = spaces.Discrete(1000)
        self.observation_space = spaces.Discrete(3)  # 0: start, 1: higher, 2: lower

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[int, dict]:
        super().reset(seed=seed)
        return 0, {}

    def step(self, action: int) -> tuple[int, float, bool, bool, dict]:
        if action == self.secret:
            return 0, 1.0, True, False, {}
        return (1 if action < self.secret else 2), 0.0, False, False, {}


gymnasium.register("GuessNumber-v0", entry_point=GuessNumber)


class GuessText:
    """The game in words: a problem is its secret (the adapter's draw, a string, which the prompt never shows); the
    model writes a number a turn and reads `higher`, `lower` or `start`."""

    actions = tuple(str(number) for number in range(1000))

    def draw(self, rng: random.Random) -> str:
        return str(rng.randrange(1000))

    def prompt(self, options: str, observation: str) -> str:
        return f"guess a number from 0 to 999: {observation}"

    def make(self, options: str) -> Any:
        return gymnasium.make("GuessNumber-v0", secret=int(options))

    def render(self, env: Any, observation: Any) -> str:
        return ("start", "higher", "lower")[int(observation)]

    def action(self, turn: str) -> int | None:
        word = turn.strip()
        return int(word) if word in self.actions else None

    def solution(self, options: str) -> list[str]:
        """Binary search: the warm start's demonstrations."""
        low, high, moves = 0, 999, []
        while True:
            guess = (low + high) // 2
            moves.append(str(guess))
            if guess == int(options):
                return moves
            low, high = (guess + 1, high) if guess < int(options) else (low, guess - 1)
