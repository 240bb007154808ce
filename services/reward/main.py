"""Reward router service entry: wire the bus, the tokenizer and the local pool, then route until cancelled."""

from __future__ import annotations

import numpy as np

from services.reward.pool import RewardPool
from services.reward.router import RewardRouter
from shared.bus import RedisBus
from shared.config import JobConfig
from shared.tokenizer import load_tokenizer


async def run(config: JobConfig, redis_url: str, model_dir: str, consumer: str) -> None:
    """Run the reward router for `config.job_id` until cancelled."""
    tokenizer = load_tokenizer(model_dir)

    def detokenize(ids: np.ndarray) -> str:
        return tokenizer.decode(ids.tolist())

    bus = RedisBus(
        redis_url,
        config.job_id,
        max_deliveries=config.redis.max_deliveries,
        claim_idle_ms=config.redis.claim_idle_ms,
    )
    pool = RewardPool(config.reward.num_workers, config.reward.timeout_s)
    try:
        router = RewardRouter(
            bus,
            pool,
            detokenize,
            consumer=consumer,
            max_retries=config.reward.max_retries,
            backend=config.reward.backend,
        )
        await router.run()
    finally:
        pool.close()
        await bus.close()
