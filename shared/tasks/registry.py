"""Tasks by name: the registry of tasks defined in code (the built-in ones, and any a user module adds with
`register_task`), and a job's `TaskSet`, those plus the tasks its config's entries describe, built once at a
service's entry (`JobConfig.build_tasks`) and passed in."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jetroll.shared.tasks.arithmetic import ArithmeticTask
from jetroll.shared.tasks.base import Task
from jetroll.shared.tasks.calculator import CalculatorTask
from jetroll.shared.tasks.count import CountTask

TASKS: dict[str, Task] = {}
# a reward function by name, `(completion, answer) -> RewardOutput`: the entry hands in jetroll.functions' registry
Rewards = Mapping[str, Callable[[str, str], Any]]


def register_task(task: Task) -> Task:
    """Add a task to TASKS under `task.name`; a different task already holding that name is an error."""
    existing = TASKS.get(task.name)
    if existing is not None and existing != task:
        raise ValueError(f"task {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


class UnknownTask(KeyError, ValueError):
    """A KeyError, so that a TaskSet's `in` and `get` work; a ValueError, as the registry's lookups have raised."""

    def __str__(self) -> str:
        return str(self.args[0])


class TaskSet(Mapping[str, Task]):
    """One job's tasks by name: the registered ones (as they were when it was built) and its configured ones; with
    the reward functions that score them where its entry scores (an evaluation, a warm start's probe)."""

    def __init__(self, configured: Mapping[str, Task] | None = None, rewards: Rewards | None = None) -> None:
        self._tasks = {**TASKS, **(configured or {})}
        self._rewards = rewards

    def __getitem__(self, name: str) -> Task:
        try:
            return self._tasks[name]
        except KeyError:
            raise UnknownTask(f"unknown task {name!r}; valid: {sorted(self._tasks)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def reward_fn(self, task: Task) -> Callable[[str, str], Any]:
        """The function that scores `task`'s completions (an agent's task is scored by its agent, not here)."""
        if self._rewards is None:
            raise ValueError(f"task {task.name!r}: this task set was built without reward functions; build it "
                             "with the rewards (jetroll.functions.scoring.job_tasks) where it scores completions")
        try:
            return self._rewards[task.reward]
        except KeyError:
            raise ValueError(f"unknown reward {task.reward!r}; valid: {sorted(self._rewards)}") from None


register_task(ArithmeticTask())
register_task(CountTask())
# a mid-length variant (159-character answers) that RL runs on 2 cores can afford: `bench precision` uses it
register_task(CountTask(name="count32", length=32))
register_task(CalculatorTask())
