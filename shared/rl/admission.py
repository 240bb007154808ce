"""Admission control: a group is admitted only while admitted <= v * B + the window (dropped groups excluded). The
window is (eta + 1) * B, plus, for each task with a larger eta of its own, its share of B for each version more."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from jetroll.shared.config.job import JobConfig
from jetroll.shared.seeds import derive_seed
from jetroll.shared.tasks.base import Problem, Task


def task_shares(config: JobConfig) -> dict[str, float]:
    total = sum(task.weight for task in config.tasks)
    return {task.name: task.weight / total for task in config.tasks}


def task_quotas(config: JobConfig) -> dict[str, int]:
    """Groups of each task in a step of B: its weight share, rounded by largest remainder so they sum to B."""
    size = config.trainer.groups_per_step
    exact = {name: share * size for name, share in task_shares(config).items()}
    quotas = {name: math.floor(value) for name, value in exact.items()}
    by_remainder = sorted(exact, key=lambda name: quotas[name] - exact[name])
    for name in by_remainder[:size - sum(quotas.values())]:
        quotas[name] += 1
    return quotas


def in_flight_caps(config: JobConfig) -> dict[str, int]:
    """Groups of each task admitted but not yet trained: its weight share of B for each of its eta + 1 versions, so
    a slow task's backlog never fills the window and starves the others' rollout pools."""
    size = config.trainer.groups_per_step
    return {name: math.ceil(share * (config.task_eta(name) + 1) * size) for name, share in task_shares(config).items()}


def admission_window(config: JobConfig) -> int:
    """Groups admitted beyond those trained: (eta + 1) * B, and for a task with a larger eta of its own, its share of
    B for each version more, so that its longer-lived groups do not take the others' room."""
    size, eta = config.trainer.groups_per_step, config.staleness.eta
    extra = sum(math.ceil(share * max(0, config.task_eta(name) - eta) * size)
                for name, share in task_shares(config).items())
    return (eta + 1) * size + extra


def in_flight_slack(config: JobConfig) -> dict[str, int]:
    """What the in-flight index adds to a task's groups' scores: its eta_hard minus the job's, so that the trainer's
    one query at the job's eta_hard finds each group when its own task's bound is due (protocol/in_flight.py)."""
    return {entry.name: config.task_eta_hard(entry.name) - config.staleness.eta_hard for entry in config.tasks}


@dataclass(slots=True)
class Admission:
    """The bound on admitted groups, and what each group draws."""

    groups_per_step: int
    window: int  # groups admitted beyond the trained ones (`admission_window`)
    max_steps: int
    num_admitted: int = 0
    num_dropped: int = 0
    task_weights: dict[str, float] = field(default_factory=dict)
    task_caps: dict[str, int] | None = None  # per-task in-flight caps; None: the global bound only

    def num_allowed(self, version: int) -> int:
        """How many more groups may be admitted now that the trainer is at `version`."""
        bound = version * self.groups_per_step + self.window
        total = self.max_steps * self.groups_per_step
        live = self.num_admitted - self.num_dropped
        return max(0, min(bound, total) - live)

    def pick_task(self, in_flight: dict[str, int], rng: random.Random) -> str | None:
        """The task of a new group, drawn by weight among the tasks under their in-flight cap (None: all at it)."""
        names = [name for name in self.task_weights
                 if self.task_caps is None or in_flight.get(name, 0) < self.task_caps[name]]
        if not names:
            return None
        return rng.choices(names, weights=[self.task_weights[n] for n in names])[0]

    def draw(self, tasks: Mapping[str, Task], job_seed: int, index: int,
             in_flight: dict[str, int]) -> tuple[Task, Problem] | None:
        """Group `index`'s task and problem (None: every task is at its in-flight cap). Its draws are its own, a pure
        function of the job's seed and the index: a restarted controller, or a peer's run of the same job, draws the
        same problem for it."""
        rng = random.Random(derive_seed(job_seed, "problem", index))
        name = self.pick_task(in_flight, rng)
        if name is None:
            return None
        task = tasks[name]
        return task, task.sample(rng, index)
