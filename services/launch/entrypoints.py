"""The one table of service entry points: what `jetroll <service>`, a Ray actor and a watcher's child all run."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

from jetroll.shared.config.job import JobConfig

SERVICES = ("controller", "rollout", "reward", "trainer")


# glibc's default raises its mmap threshold (to 32 MB) after the first large free, so later weight-sized tensors
# come from the heap, and what they free stays resident: at the 0.5B shape the trainer kept 1.8 GB more between steps
LARGE_ALLOCATION_BYTES = 4 << 20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def prepare_process(service: str, config: JobConfig) -> None:
    """A service process's set-up: torch threads from the config, and large tensors mapped apart so that freeing
    one gives its memory back to the system."""
    import torch

    torch.set_num_threads({"rollout": config.rollout.threads, "reward": config.reward.threads,
                           "trainer": config.trainer.threads, "controller": 1}[service])
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES)
    except AttributeError:  # not glibc (macOS): its allocator already returns large frees
        pass


async def service_main(name: str, config: JobConfig, redis_url: str, consumer: str, run_dir: Path,
                       pool: str | None = None) -> None:
    """Run service `name` of one job until it finishes or is cancelled."""
    from jetroll.shared.protocol.bus import RedisBus
    from jetroll.shared.store import setup_store

    if name == "reward":
        from jetroll.services.reward.main import run as run_reward

        assert config.model.path
        await run_reward(config, redis_url, config.model.path, consumer)
        return
    bus = RedisBus(redis_url, config.job_id, max_deliveries=config.redis.max_deliveries,
                   claim_idle_ms=config.redis.claim_idle_ms)
    store = setup_store(config.store, config.job_id, run_dir)
    try:
        if name == "trainer":
            from jetroll.services.trainer.trainer import Trainer

            await Trainer(config, bus, store, consumer).run()
        elif name == "rollout":
            from jetroll.services.rollout.worker import RolloutWorker

            await RolloutWorker(config, bus, store, consumer, pool).run()
        else:
            from jetroll.services.controller.controller import Controller

            summary = await Controller(config, bus, store, run_dir).run()
            print(json.dumps({k: summary[k] for k in ("steps", "accuracy_before", "accuracy_after",
                                                      "rollout_tokens_per_s", "mismatch_mean_abs_logprob")}))
    finally:
        await bus.close()
