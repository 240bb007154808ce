"""tasks: a `kind: reasoning_gym` entry, one of reasoning-gym's procedural datasets (shared/tasks/reasoning.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from jetroll.shared.config.base import TaskMixEntry
from jetroll.shared.tasks.base import Task
from jetroll.shared.tasks.reasoning import ReasoningGymTask, reasoning_gym


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
        return ReasoningGymTask(name=self.name, dataset=self.dataset, options=tuple(sorted(self.options.items())),
                                seed=seed, max_new_tokens=self.max_new_tokens)
