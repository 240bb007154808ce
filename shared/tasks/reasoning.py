"""reasoning-gym's procedural datasets as tasks (`kind: reasoning_gym` in a job's tasks; the `reasoning` extra).

A problem is one entry of `reasoning_gym.create_dataset(name, seed, size, **options)`: its question is the prompt,
its answer the warm start's target, and the dataset's own `score_answer` scores a completion. Training entries come
from the job-seeded dataset, drawn by the group's own RNG (a pure function of the job's seed and the admission index);
held-out and probe entries from one fixed-seed dataset per task, and the warm start's from another, so a base does
not depend on the job's seed. Small procedural spaces repeat, so every split is
jetroll's hash split on the question: a held-out question is never trained on, whichever seed drew it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, model_validator

from jetroll.shared.tasks.base import Problem, Split, Task, split_of
from jetroll.shared.tasks.entry import EntryTask, TaskMixEntry

EXTRA = "reasoning-gym needs the `reasoning` extra: pip install 'jetroll[reasoning]'"
SPLIT_SEED = 1_000_003  # the held-out and probe entries' dataset seed, the same in every job
WARM_START_SEED = 1_000_033  # the warm start's entries' dataset seed, so a base is the same for every job seed


def reasoning_gym() -> Any:
    """The reasoning_gym module, or an ImportError naming the extra."""
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(EXTRA) from None
    return reasoning_gym


@lru_cache(maxsize=32)
def dataset(name: str, options: str, seed: int, size: int) -> Any:
    """A reasoning-gym dataset (`options`: its config as sorted JSON); entries are generated on indexing."""
    return reasoning_gym().create_dataset(name, seed=seed, size=size, **json.loads(options))


@dataclass(frozen=True, slots=True)
class EntryRef:
    """What a problem's answer holds: where its entry is, so the reward regenerates it and scores against it."""

    dataset: str
    options: str
    seed: int
    size: int
    index: int

    @classmethod
    def parse(cls, answer: str) -> EntryRef:
        return cls(**json.loads(answer))

    def dump(self) -> str:
        return json.dumps({"dataset": self.dataset, "options": self.options, "seed": self.seed, "size": self.size,
                           "index": self.index}, sort_keys=True)

    def entry(self) -> dict[str, Any]:
        return dataset(self.dataset, self.options, self.seed, self.size)[self.index]

    def score(self, completion: str) -> float:
        """The dataset's own score of a completion (its text, stripped), in [0, 1]."""
        data = dataset(self.dataset, self.options, self.seed, self.size)
        return float(data.score_answer(answer=completion.strip(), entry=data[self.index]))


class ReasoningGymTaskConfig(TaskMixEntry):
    """A reasoning-gym dataset (`kind: reasoning_gym`; needs the `reasoning` extra), scored by its own
    `score_answer`. Its prompts are English with capitals: the model needs a byte-level tokenizer."""

    kind: Literal["reasoning_gym"] = Field(description="marks a reasoning-gym dataset")
    name: str = Field(min_length=1, description="the task's name in events, metrics and reward.task_backends")
    dataset: str = Field(min_length=1, description="a reasoning-gym dataset name (leg_counting, basic_arithmetic, "
                         "...), as `reasoning_gym.create_dataset` takes it")
    options: dict[str, Any] = Field(default_factory=dict, description="the dataset's config (its difficulty)")
    max_new_tokens: int = Field(32, ge=1, description="generation budget of a completion (capped by "
                                "rollout.max_new_tokens)")

    @model_validator(mode="after")
    def _runnable(self) -> ReasoningGymTaskConfig:
        reasoning_gym()  # a missing extra fails here, in one line naming it
        try:
            json.dumps(self.options)
            reasoning_gym().create_dataset(self.dataset, seed=0, size=1, **self.options)[0]
        except Exception as exc:  # reasoning-gym's own message names what is wrong
            raise ValueError(f"reasoning_gym task {self.name}: {type(exc).__name__}: {exc}") from None
        return self

    def build(self, seed: int, known: Mapping[str, Task]) -> ReasoningGymTask:
        """The task this entry describes, in a job of `seed`."""
        return ReasoningGymTask(self, seed)


@dataclass(frozen=True)
class ReasoningGymTask(EntryTask):
    entry: ReasoningGymTaskConfig
    seed: int = 0  # the job's: its training entries' dataset
    size: int = 100_000  # entries a split draws from
    reward: str = "reasoning_gym"

    @property
    def options(self) -> tuple[tuple[str, Any], ...]:
        """The dataset's config, sorted: what its fingerprint and entries are keyed on."""
        return tuple(sorted(self.entry.options.items()))

    def _ref(self, seed: int, index: int) -> EntryRef:
        return EntryRef(self.entry.dataset, json.dumps(dict(self.options), sort_keys=True), seed, self.size, index)

    def _problem(self, ref: EntryRef) -> tuple[Problem, Split]:
        question = ref.entry()["question"]
        return Problem(prompt=question, answer=ref.dump()), split_of(f"{self.name}:{question}")

    def sample(self, rng: random.Random, index: int = 0) -> Problem:
        while True:
            problem, split = self._problem(self._ref(self.seed, rng.randrange(self.size)))
            if split == "train":
                return problem

    def _split(self, n: int, split: Split) -> list[Problem]:
        problems, seen = [], set()
        for index in range(self.size):
            if len(problems) == n:
                return problems
            problem, of = self._problem(self._ref(SPLIT_SEED, index))
            if of == split and problem.prompt not in seen:
                seen.add(problem.prompt)
                problems.append(problem)
        raise ValueError(f"{self.name}: asked for {n} {split} problems; found {len(problems)} in {self.size} entries")

    def heldout(self, n: int) -> list[Problem]:
        return self._split(n, "heldout")

    def probe(self, n: int) -> list[Problem]:
        return self._split(n, "probe")

    def sft_sample(self, rng: random.Random) -> Problem:
        return replace(self, seed=WARM_START_SEED).sample(rng)

    def fingerprint(self) -> str:
        """What a warm start on this task depends on: its definition, without the job's seed (sft_sample's own)."""
        return json.dumps([self.entry.dataset, self.options, self.size, self.max_new_tokens])

    def sft_completion(self, problem: Problem) -> str:
        return str(EntryRef.parse(problem.answer).entry()["answer"])
