"""The one table of service entry points: what `jetroll <service>`, a Ray actor and a watcher's child all run."""

from __future__ import annotations

import asyncio
import ctypes
import json
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from jetroll.shared.config.job import JobConfig

SERVICES = ("controller", "rollout", "reward", "trainer", "env")


# glibc's default raises its mmap threshold (to 32 MB) after the first large free, so later weight-sized tensors
# come from the heap, and what they free stays resident: at the 0.5B shape the trainer kept 1.8 GB more between steps
LARGE_ALLOCATION_BYTES = 4 << 20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def prepare_process(service: str, config: JobConfig) -> None:
    """A service process's set-up: torch threads from the config, and large tensors mapped apart so that freeing
    one gives its memory back to the system."""
    import torch

    torch.set_num_threads({"rollout": config.rollout.threads, "reward": config.reward.threads,
                           "trainer": config.trainer.threads, "controller": 1, "env": 1}[service])
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES)
    except AttributeError:  # not glibc (macOS): its allocator already returns large frees
        pass


async def service_main(name: str, config: JobConfig, redis_url: str, consumer: str, run_dir: Path,
                       pool: str | None = None) -> None:
    """Run service `name` of one job until it finishes or is cancelled."""
    from jetroll.functions.scoring import job_tasks
    from jetroll.shared.protocol.bus import RedisBus
    from jetroll.shared.store import setup_store

    tasks = job_tasks(config)  # built once, here, and passed in

    if name == "reward":
        from jetroll.services.reward.main import run as run_reward

        assert config.model.path
        await run_reward(config, tasks, redis_url, config.model.path, consumer)
        return
    bus = RedisBus.of_job(redis_url, config.job_id, config.redis)
    store = setup_store(config.store, config.job_id, run_dir)
    try:
        if name == "trainer":
            from jetroll.services.trainer.trainer import Trainer

            await Trainer(config, tasks, bus, store, consumer).run()
        elif name == "rollout":
            from jetroll.services.rollout.worker import RolloutWorker

            await RolloutWorker(config, tasks, bus, store, consumer, pool).run()
        elif name == "env":
            from jetroll.services.env.worker import EnvWorker

            await EnvWorker(config, tasks, bus, consumer, pool).run()
        else:
            from jetroll.services.controller.controller import Controller

            summary = await Controller(config, tasks, bus, store, run_dir).run()
            print(json.dumps({k: summary[k] for k in ("steps", "accuracy_before", "accuracy_after",
                                                      "rollout_tokens_per_s", "mismatch_mean_abs_logprob")}))
    finally:
        await bus.close()


async def until_sigterm(main: Coroutine[Any, Any, object], heartbeat_file: Path | None) -> None:
    """Run `main` in this task, which SIGTERM cancels (a clean stop); touch the heartbeat file meanwhile."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    beat = None
    if heartbeat_file is not None:
        from jetroll.services.launch.watch import heartbeat

        beat = asyncio.create_task(heartbeat(heartbeat_file))
    try:
        await main
    finally:
        if beat is not None:
            beat.cancel()


async def watch_main(service: str, redis_url: str, runs_dir: Path, consumer: str | None, pool: str | None) -> None:
    """`jetroll <service> --watch`: each job's service runs as `jetroll <service> --config ...` in a process of its
    own (launch/watch.py)."""
    from jetroll.services.launch import watch

    argv = watch.service_argv(redis_url, ["--pool", pool] if pool else [])
    if service == "controller":  # a fixed consumer, so a restarted watcher finds its unacked job
        await watch.watch_jobs(redis_url, runs_dir, consumer or "controller", argv)
    else:
        await watch.watch_service(service, redis_url, runs_dir, consumer or watch.default_consumer(service), argv)
