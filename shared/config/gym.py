"""tasks: a `kind: gymnasium` entry, a gymnasium environment as a multi-turn text task (shared/tasks/gym_text.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from jetroll.shared.config.base import TaskMixEntry
from jetroll.shared.config.faults import EnvFaults
from jetroll.shared.tasks.base import Task
from jetroll.shared.tasks.gym_text import ADAPTERS, GymTask, gymnasium, text_adapter


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
        return GymTask(name=self.name, env_id=self.env_id, adapter_options=tuple(sorted(self.options.items())),
                       adapter_path=self.adapter, max_turns=self.max_turns, max_new_tokens=self.max_new_tokens)
