"""Reward router service entry: wire the bus, the tokenizer and the tasks' backends, then route until cancelled."""

from __future__ import annotations

from contextlib import AsyncExitStack

import numpy as np

from jetroll.services.reward.backends import backends_in_use, setup_backend
from jetroll.services.reward.router import RewardRouter
from jetroll.shared.config.job import JobConfig
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.validate import EventLimits
from jetroll.shared.tasks.registry import TaskSet


async def run(config: JobConfig, tasks: TaskSet, redis_url: str, model_dir: str, consumer: str) -> None:
    """Run the reward router for `config.job_id` until cancelled."""
    tokenizer = load_tokenizer(model_dir)

    def detokenize(ids: np.ndarray) -> str:
        return tokenizer.decode(ids.tolist())

    bus = RedisBus.of_job(redis_url, config.job_id, config.redis)
    reward = config.reward
    async with AsyncExitStack() as stack:
        stack.push_async_callback(bus.close)
        backends = {}
        for name in backends_in_use(reward, [task.name for task in config.tasks]):
            backend = setup_backend(name, reward, redis_url=redis_url, job_id=config.job_id)
            backends[name] = await stack.enter_async_context(backend)
        router = RewardRouter(
            bus,
            backends,
            detokenize,
            limits=EventLimits.of(config, tasks, tokenizer.vocab_size),
            task_rewards={entry.name: tasks[entry.name].reward for entry in config.tasks},
            consumer=consumer,
            default_backend=reward.backend,
            task_backends=reward.task_backends,
            max_retries=reward.max_retries,
            max_throttle_retries=reward.max_throttle_retries,
            throttle_backoff_s=reward.throttle_backoff_s,
        )
        await router.run()
