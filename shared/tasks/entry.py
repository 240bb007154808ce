"""What every kind of `tasks` entry has: its share of the mix, its own staleness bound, and for a multi-turn task's
environment, faults on purpose. Each kind's entry lives beside its task (dataset.py, gym_text.py, ...)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from jetroll.shared.schema import Strict


class TaskMixEntry(Strict):
    """What every kind of `tasks` entry has besides its name: its share of the mix and its own staleness bound."""

    weight: float = Field(1.0, gt=0, description="relative sampling weight in the task mix")
    max_staleness: int | None = Field(
        None, ge=0, description="the task's own eta (None: staleness.max_staleness): its groups are waited for, and "
        "its tokens masked, only past twice this lag, and its share of the admission window grows with it; a slow "
        "environment's task takes a larger one, so that it neither stalls the trainer nor loses its groups "
        "(docs/architecture.md, \"Many tasks in one job\"). Async mode only")


class EnvFaults(Strict):
    """Faults injected into every episode's environment (`FlakyEnv`, shared/tasks/env.py): each reset and step
    waits `delay_s`, then fails with probability `failure_rate`. The failures are drawn per episode from the job's
    seed and the trajectory's id, so a run's faults repeat."""

    delay_s: float = Field(0.0, ge=0, description="seconds added to every reset and step")
    failure_rate: float = Field(0.0, ge=0, lt=1, description="chance that a reset or step raises (then retried as "
                                "any environment failure is: rollout.env_max_retries)")


class EntryTask:
    """A task built from its `tasks` entry (each kind's dataclass holds it as `entry`): its name and its budget are
    the entry's, so each field is written once, in the entry."""

    entry: Any

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def max_new_tokens(self) -> int:
        return self.entry.max_new_tokens
