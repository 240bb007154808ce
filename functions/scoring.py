"""A job's tasks with the reward functions that score them, built at a service's entry; and the checks of those
rewards, which a config cannot make itself (jetroll.shared never imports jetroll.functions). Not in rewards.zip."""

from __future__ import annotations

from jetroll.functions.builtin import NOT_ON_LAMBDA
from jetroll.functions.runner import REWARDS
from jetroll.shared.config.job import JobConfig
from jetroll.shared.errors import ConfigError
from jetroll.shared.tasks.agent import ENV_REWARD
from jetroll.shared.tasks.registry import TaskSet


def job_tasks(config: JobConfig) -> TaskSet:
    """`config`'s tasks with the rewards that score them; ConfigError for a reward that is not registered (unless
    reward.modules, whose rewards register where they are imported, may hold it) or that cannot run on its task's
    reward backend."""
    tasks = config.build_tasks(REWARDS)
    for entry in config.tasks:
        name = tasks[entry.name].reward
        if name not in REWARDS and name != ENV_REWARD and not config.reward.modules:
            raise ConfigError(f"task {entry.name}: unknown reward {name!r}; valid: {sorted(REWARDS)} (or name its "
                              "module in reward.modules)")
        if name in NOT_ON_LAMBDA and config.reward.backend_of(entry.name) == "lambda":
            raise ConfigError(f"task {entry.name!r}: its reward {name!r} replays the task through jetroll.shared and "
                              "its extra, which the Lambda package leaves out; score it on the local, inline or "
                              "celery backend")
    return tasks
