"""gymnasium environments as multi-turn text tasks (`kind: gymnasium` in a job's tasks).

A registered environment is made with `gymnasium.make` and driven through a text adapter for its `env_id`: the
adapter draws each problem's options (a map, a seed), renders observations in the model's vocabulary and parses the
model's turns into actions. A turn that does not parse is a bad move: the environment is not stepped and the episode
goes on, one turn spent. The same gymnasium environment replays a finished transcript for its reward, so what is
trained is what the environment said.

FrozenLake-v1 comes first, as ROLL runs it: `is_slippery=False`, maps from `generate_random_map`, one per problem
(seeded), so the held-out split (jetroll's hash split on the map) is disjoint from training.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from pydantic import Field, model_validator

from jetroll.shared.tasks.base import DrawnTask, Problem, Task, import_path
from jetroll.shared.tasks.entry import EntryTask, EnvFaults, TaskMixEntry
from jetroll.shared.tasks.env import EnvStep

EXTRA = "gymnasium needs the `gym` extra: pip install 'jetroll[gym]'"


def gymnasium() -> Any:
    """The gymnasium module, or an ImportError naming the extra."""
    try:
        import gymnasium
    except ImportError:
        raise ImportError(EXTRA) from None
    return gymnasium


class TextAdapter(Protocol):
    """An environment in words: `draw` one problem's options, `make` its environment, the `prompt` (the options and
    the first observation, rendered), `render` an observation, `action` of a model turn (None: it does not parse),
    and a shortest `solution` for the warm start."""

    actions: tuple[str, ...]

    def draw(self, rng: random.Random) -> str: ...

    def make(self, options: str) -> Any: ...

    def prompt(self, options: str, observation: str) -> str: ...

    def render(self, env: Any, observation: Any) -> str: ...

    def action(self, turn: str) -> int | None: ...

    def solution(self, options: str) -> list[str]: ...


MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))  # (row, col) steps of left down right up


@dataclass(frozen=True)
class FrozenLakeText:
    """FrozenLake-v1 in lowercase: the map is its rows joined by `/` (`s` start, `f` frozen, `h` hole, `g` goal),
    a position is `at <row> <col>`, an action is one of `left down right up`. With `view: neighbours` each
    observation also names the four cells a move would reach, in action order (`at 1 0 - f h s`: left off the map,
    down frozen, right a hole, up the start), as ROLL redraws the grid every turn: a BPE tokenizer merges the map
    string into multi-cell tokens, and finding a cell in it from its row and column is what a small model fails at."""

    size: int = 4
    frozen_prob: float = 0.8
    view: str = "position"
    actions: tuple[str, ...] = ("left", "down", "right", "up")  # gymnasium's action ids, in order
    views: ClassVar[tuple[str, ...]] = ("position", "neighbours")

    def __post_init__(self) -> None:
        if self.view not in self.views:
            raise ValueError(f"FrozenLake view {self.view!r} is not one of {list(self.views)}")

    def draw(self, rng: random.Random) -> str:
        gymnasium()
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        rows = generate_random_map(size=self.size, p=self.frozen_prob, seed=rng.getrandbits(31))
        return "/".join(rows).lower()

    def make(self, options: str) -> Any:
        return gymnasium().make("FrozenLake-v1", desc=options.upper().split("/"), is_slippery=False)

    def prompt(self, options: str, observation: str) -> str:
        return f"{options} {observation}"

    def render(self, env: Any, observation: Any) -> str:
        row, col = divmod(int(observation), self.size)
        if self.view == "position":
            return f"at {row} {col}"
        cells = env.unwrapped.desc
        seen = []
        for dr, dc in MOVES:
            r, c = row + dr, col + dc
            seen.append(cells[r][c].decode().lower() if 0 <= r < len(cells) and 0 <= c < len(cells[0]) else "-")
        return f"at {row} {col} " + " ".join(seen)

    def action(self, turn: str) -> int | None:
        word = turn.strip()
        return self.actions.index(word) if word in self.actions else None

    def solution(self, options: str) -> list[str]:
        """A shortest path from `s` to `g` around the holes (breadth first, actions tried in id order)."""
        rows = options.split("/")
        start = next((r, c) for r, row in enumerate(rows) for c, cell in enumerate(row) if cell == "s")
        paths: dict[tuple[int, int], list[str]] = {start: []}
        queue = deque([start])
        while queue:
            r, c = queue.popleft()
            if rows[r][c] == "g":
                return paths[(r, c)]
            for name, (dr, dc) in zip(self.actions, MOVES, strict=True):
                nr, nc = r + dr, c + dc
                if 0 <= nr < len(rows) and 0 <= nc < len(rows[0]) and rows[nr][nc] != "h" and (nr, nc) not in paths:
                    paths[(nr, nc)] = [*paths[(r, c)], name]
                    queue.append((nr, nc))
        raise ValueError(f"no path from s to g on {options}")


ADAPTERS: dict[str, type] = {"FrozenLake-v1": FrozenLakeText}


def text_adapter(env_id: str, options: dict[str, Any], adapter: str | None = None) -> TextAdapter:
    """The text adapter of `env_id` made with `options`: `adapter` (an import path, `module:Class`) when given,
    else the built-in one for that env id."""
    if adapter is not None:
        return import_adapter(adapter)(**options)
    try:
        built_in = ADAPTERS[env_id]
    except KeyError:
        raise ValueError(f"no text adapter for gymnasium env {env_id!r}; built in: {sorted(ADAPTERS)}; name your own "
                         "with the task's `adapter: module:Class`") from None
    return built_in(**options)


def import_adapter(path: str) -> type:
    """A user's adapter class from `module:Class`, or a ValueError that says which part is missing."""
    found = import_path(path, "adapter")
    if not isinstance(found, type):
        raise ValueError(f"adapter {path!r} is not a class")
    return found


class GymEnv:
    """One episode of a gymnasium environment behind the Environment API (shared/tasks/env.py)."""

    def __init__(self, adapter: TextAdapter, turn_end: str, max_turns: int) -> None:
        self.adapter = adapter
        self.turn_end = turn_end
        self.max_turns = max_turns
        self.env: Any = None
        self.observation: Any = None
        self.turns = 0

    def start(self, options: str) -> None:
        self.env = self.adapter.make(options)
        self.observation, _ = self.env.reset(seed=0)
        self.turns = 0

    def advance(self, turn: str) -> EnvStep:
        """One model turn: a parsed action steps the environment, anything else is a bad move that spends the
        turn; the episode ends when the environment says so or at `max_turns`."""
        assert self.env is not None, "step before reset"
        self.turns += 1
        action = self.adapter.action(turn)
        reward, done = 0.0, False
        if action is not None:
            self.observation, reward, terminated, truncated, _ = self.env.step(action)
            done = terminated or truncated
        if done or self.turns >= self.max_turns:
            return EnvStep(done=True, reward=float(reward))
        return EnvStep(observation=self.adapter.render(self.env, self.observation) + self.turn_end)

    async def reset(self, problem: Problem) -> None:
        self.start(GymProblem.parse(problem.answer).options)

    async def step(self, turn: str) -> EnvStep:
        return self.advance(turn)


@dataclass(frozen=True, slots=True)
class GymProblem:
    """What a problem's answer holds: everything its environment and reward are made again from."""

    env_id: str
    options: str  # the adapter's draw: a FrozenLake map
    adapter_options: dict[str, Any]
    max_turns: int
    adapter: str | None = None  # a user's adapter (`module:Class`); None: the env id's built-in one

    @classmethod
    def parse(cls, answer: str) -> GymProblem:
        return cls(**json.loads(answer))

    def answer(self) -> str:
        fields = {"env_id": self.env_id, "options": self.options, "adapter_options": self.adapter_options,
                  "max_turns": self.max_turns}
        if self.adapter is not None:  # a built-in adapter's answers stay as they were
            fields["adapter"] = self.adapter
        return json.dumps(fields, sort_keys=True)

    def replay(self, transcript: str, turn_end: str = "\n") -> tuple[float, bool]:
        """(the reward, whether the episode ended) of a finished transcript: model turns and the observations after
        them alternate, one per `turn_end`."""
        env = GymEnv(text_adapter(self.env_id, self.adapter_options, self.adapter), turn_end, self.max_turns)
        env.start(self.options)
        for turn in transcript.split(turn_end)[::2]:
            step = env.advance(turn)
            if step.done:
                return step.reward or 0.0, True
        return 0.0, False


class GymTaskConfig(TaskMixEntry):
    """A registered gymnasium environment with a text adapter (`kind: gymnasium`; needs the `gym` extra)."""

    kind: Literal["gymnasium"] = Field(description="marks a gymnasium environment")
    name: str = Field(min_length=1, description="the task's name in events, metrics and reward.task_backends")
    env_id: str = Field("FrozenLake-v1", description="a gymnasium env id (`module:EnvId` imports the module that "
                        f"registers it first); built-in text adapters: {sorted(ADAPTERS)}")
    adapter: str | None = Field(None, pattern=r"^[\w.]+:\w+$", description="your own text adapter, `module:Class` "
                                "(shared/tasks/gym_text.py's TextAdapter: draw, make, render, action, solution); "
                                "None: the env id's built-in one")
    options: dict[str, Any] = Field(default_factory=dict, description="the text adapter's options (FrozenLake-v1: "
                                    "size, the map's side, 4 by default; frozen_prob, a cell's chance to be "
                                    "frozen, 0.8)")
    max_turns: int = Field(10, ge=1, description="model turns before an episode ends unsolved")
    env_faults: EnvFaults | None = Field(None, description="the environment made slow and flaky on purpose: "
                                         "{delay_s, failure_rate}")
    max_new_tokens: int = Field(96, ge=1, description="generation budget of an episode, observations included "
                                "(capped by rollout.max_new_tokens)")

    @model_validator(mode="after")
    def _runnable(self) -> GymTaskConfig:
        gymnasium()  # a missing extra fails here, in one line naming it
        text_adapter(self.env_id, self.options, self.adapter)  # the adapter takes its options
        return self

    def build(self, seed: int, known: Mapping[str, Task]) -> GymTask:
        """The task this entry describes."""
        return GymTask(self)


@dataclass(frozen=True)
class GymTask(EntryTask, DrawnTask):
    """A gymnasium environment as a multi-turn task: the prompt is the problem's options (a FrozenLake map) and the
    first observation; the answer (`GymProblem`) makes the environment and its reward again."""

    splits_seed: ClassVar[str] = "gymnasium"
    entry: GymTaskConfig
    reward: str = "gymnasium"
    turn_end: str = "\n"
    adapter: TextAdapter = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        adapter = text_adapter(self.entry.env_id, dict(self.adapter_options), self.adapter_path)
        object.__setattr__(self, "adapter", adapter)

    @property
    def adapter_options(self) -> tuple[tuple[str, Any], ...]:
        """The adapter's options, sorted: what a problem and the fingerprint carry."""
        return tuple(sorted(self.entry.options.items()))

    @property
    def adapter_path(self) -> str | None:
        """A user's adapter, `module:Class`; None: the env id's built-in one."""
        return self.entry.adapter

    def _draw(self, rng: random.Random) -> tuple[str]:
        return (self.adapter.draw(rng),)

    def key(self, options: str) -> str:
        return f"{self.entry.env_id}:{options}"

    def make(self, options: str) -> Problem:
        env = GymEnv(self.adapter, self.turn_end, self.entry.max_turns)
        env.start(options)
        problem = GymProblem(self.entry.env_id, options, dict(self.adapter_options), self.entry.max_turns,
                             self.adapter_path)
        prompt = self.adapter.prompt(options, self.adapter.render(env.env, env.observation))
        return Problem(prompt=prompt + self.turn_end, answer=problem.answer())

    def fingerprint(self) -> str:
        """What a warm start on this task depends on: its definition, a built-in adapter's defaults spelled out."""
        adapter = repr(self.adapter) if self.adapter_path is None else [self.adapter_path, self.adapter_options]
        return json.dumps([self.entry.env_id, adapter, self.entry.max_turns, self.max_new_tokens, self.turn_end])

    def make_env(self) -> GymEnv:
        return GymEnv(self.adapter, self.turn_end, self.entry.max_turns)

    def sft_turns(self, problem: Problem) -> list[tuple[str, str]]:
        """The shortest path, each move with the observation the environment gives after it."""
        options = GymProblem.parse(problem.answer).options
        env = self.make_env()
        env.start(options)
        return [(move, env.advance(move).observation) for move in self.adapter.solution(options)]

    def sft_completion(self, problem: Problem) -> str:
        return "".join(turn + (self.turn_end + obs if obs else "") for turn, obs in self.sft_turns(problem))
