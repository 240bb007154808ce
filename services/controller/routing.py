"""Task -> rollout pool routing: explicitly by task, else by the task's profile, else the first pool."""

from __future__ import annotations

import random
from collections.abc import Mapping

from jetroll.shared.config.rollout import RolloutConfig
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.tasks.base import Task

PROFILE_SAMPLES = 32


def task_profile(task: Task, tokenizer: Tokenizer) -> str:
    """decode_heavy when the task's completion budget is over twice its mean prompt, else prefill_heavy."""
    rng = random.Random(0)
    lengths = [len(tokenizer.encode(task.sample(rng, index).prompt)) for index in range(1, PROFILE_SAMPLES + 1)]
    mean_prompt = sum(lengths) / PROFILE_SAMPLES
    return "decode_heavy" if task.max_new_tokens > 2 * mean_prompt else "prefill_heavy"


def route_tasks(rollout: RolloutConfig, tasks: Mapping[str, Task], task_names: list[str],
                tokenizer: Tokenizer) -> dict[str, str]:
    routes = {}
    for name in task_names:
        explicit = [pool.name for pool in rollout.pools if name in pool.tasks]
        by_profile = [pool.name for pool in rollout.pools if pool.profile == task_profile(tasks[name], tokenizer)]
        routes[name] = (explicit or by_profile or [rollout.pools[0].name])[0]
    return routes
