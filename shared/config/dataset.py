"""tasks: a `kind: dataset` entry, a task read from files (the task itself is jetroll.shared.tasks.dataset)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from jetroll.shared.config.base import TaskMixEntry
from jetroll.shared.tasks.base import Task
from jetroll.shared.tasks.dataset import DatasetTask


class DatasetTaskConfig(TaskMixEntry):
    """A task read from a file (`kind: dataset`): prompts or chat messages, and answers, in JSONL or Parquet
    (Parquet needs the `data` extra), scored by a reward from the registry. See shared/tasks/dataset.py."""

    kind: Literal["dataset"] = Field(description="marks a task read from files (the other kind: `registered`)")
    name: str = Field(min_length=1, description="the task's name in events, metrics and reward.task_backends")
    path: str = Field(min_length=1, description="a .jsonl or .parquet file, or a directory of such shards (read "
                      "in name order)")
    prompt_field: str | None = Field("prompt", description="the row's prompt text (None: use messages_field)")
    messages_field: str | None = Field(None, description="the row's chat messages, a list of {role, content}, "
                                       "rendered by the model's chat template (needs model.chat_template: true)")
    answer_field: str = Field("answer", min_length=1, description="the answer the reward scores against")
    solution_field: str | None = Field(None, description="a worked solution, the warm start's target (None: the "
                                       "answer)")
    reward: str = Field(min_length=1, description="a reward by name: math, code, exact_match, token_f1, ... or "
                        "one from reward.modules")
    heldout_path: str | None = Field(None, description="a held-out file (or directory); None: heldout_fraction "
                                     "of path's rows, chosen by a hash of the prompt")
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description="share of rows held out when heldout_path is "
                                    "None")
    probe_fraction: float = Field(0.05, ge=0, lt=1, description="share of the training file kept out of "
                                  "training as the warm start's probe set")
    max_new_tokens: int = Field(64, ge=1, description="generation budget of a completion (capped by "
                                "rollout.max_new_tokens)")

    @model_validator(mode="after")
    def _one_prompt_source(self) -> DatasetTaskConfig:
        if (self.prompt_field is None) == (self.messages_field is None):
            raise ValueError(f"dataset task {self.name}: set exactly one of prompt_field and messages_field")
        if self.heldout_path is None and self.heldout_fraction + self.probe_fraction >= 1:
            raise ValueError(f"dataset task {self.name}: heldout_fraction + probe_fraction must leave rows to train "
                             "on")
        return self

    def build(self, seed: int, known: Mapping[str, Task]) -> DatasetTask:
        """The task this entry describes, in a job of `seed` (its files are read on first use)."""
        return DatasetTask(name=self.name, path=self.path, reward=self.reward, answer_field=self.answer_field,
                           prompt_field=self.prompt_field, messages_field=self.messages_field,
                           solution_field=self.solution_field, heldout_path=self.heldout_path,
                           heldout_fraction=self.heldout_fraction, probe_fraction=self.probe_fraction,
                           max_new_tokens=self.max_new_tokens, seed=seed)
