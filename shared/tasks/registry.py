"""The task registry: every task a config may name, the built-in ones registered here."""

from __future__ import annotations

from jetroll.shared.tasks.agent import AgentTask
from jetroll.shared.tasks.arithmetic import ArithmeticTask
from jetroll.shared.tasks.base import Task
from jetroll.shared.tasks.calculator import CalculatorTask
from jetroll.shared.tasks.count import CountTask
from jetroll.shared.tasks.dataset import DatasetTask
from jetroll.shared.tasks.gym_text import GymTask
from jetroll.shared.tasks.reasoning import ReasoningGymTask

TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add a task to TASKS under `task.name`; a different task already holding that name is an error."""
    existing = TASKS.get(task.name)
    if existing is not None and existing != task:
        raise ValueError(f"task {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def register_configured(task: DatasetTask | GymTask | ReasoningGymTask | AgentTask) -> None:
    """Register a task a job config describes (a dataset's, an environment's). It replaces an earlier
    configured task of its name (the last config validated in a process wins), never a built-in task."""
    existing = TASKS.get(task.name)
    if existing is not None and not isinstance(existing, DatasetTask | GymTask | ReasoningGymTask | AgentTask):
        raise ValueError(f"task {task.name!r}: a built-in task has that name")
    if existing != task:
        TASKS[task.name] = task


def get_task(name: str) -> Task:
    """The registered task called `name`; ValueError listing the valid names otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid: {sorted(TASKS)}") from None


register_task(ArithmeticTask())
register_task(CountTask())
# a mid-length variant (159-character answers) that RL runs on 2 cores can afford: `bench precision` uses it
register_task(CountTask(name="count32", length=32))
register_task(CalculatorTask())
