"""Helpers for the reward backend tests: trajectories, test tasks and a router running on a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from factories import trajectory
from helpers import wait_until_async

from jetroll.services.reward.backends.base import RewardBackend
from jetroll.services.reward.router import RewardRouter
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import ScoredEvent, TrajectoryEvent
from jetroll.shared.protocol.topology import TRAJ_RAW, TRAJ_SCORED
from jetroll.shared.protocol.validate import EventLimits
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.registry import TASKS, register_task

TESTS = Path(__file__).resolve().parents[1]
REWARD_MODULES = ("reward_test_fns", "remote_reward_fns")
REWARD_DIRS = (str(TESTS / "unit" / "reward"), str(TESTS / "integration"))  # where REWARD_MODULES live
PYTHONPATH = ":".join(REWARD_DIRS)  # for worker subprocesses
for _path in REWARD_DIRS:
    if _path not in sys.path:
        sys.path.insert(0, _path)  # spawned Lambda environments inherit sys.path


def detokenize(ids: np.ndarray) -> str:
    return "".join(chr(int(i)) for i in ids)


def registered_rewards() -> dict[str, str]:
    """Each task registered by now, by the name of its reward (what a router is given at its entry)."""
    return {name: task.reward for name, task in TASKS.items()}


def limits_under_test() -> EventLimits:
    """What the routers under test accept: the tasks registered by now, groups of 2, ids that are code points."""
    return EventLimits(vocab_rows=0x110000, group_size=2, max_seq_len=1 << 16, max_new_tokens=1 << 16,
                       max_version=1 << 30, tasks=frozenset(TASKS), pools=frozenset({"default"}))


def traj(job_id: str, traj_id: str, task: str, completion: str, answer: str, env_status: str = "ok") -> TrajectoryEvent:
    """A trajectory whose text is one token per character (`detokenize` reads it back)."""
    return trajectory(traj_id, [ord(c) for c in completion], job_id=job_id, task=task, answer=answer,
                      prompt_ids=[ord(c) for c in "1+1="], env_status=env_status)


@dataclass(frozen=True)
class RewardOnlyTask:
    """A task that only names a reward; the router never samples it."""

    name: str
    reward: str
    max_new_tokens: int = 4

    def sample(self, rng: Any, index: int = 0) -> Problem:  # pragma: no cover
        return Problem("", "")

    def heldout(self, n: int) -> list[Problem]:  # pragma: no cover
        return []

    def sft_completion(self, problem: Problem) -> str:  # pragma: no cover
        return problem.answer


@contextlib.contextmanager
def reward_tasks(**task_to_reward: str) -> Iterator[None]:
    """Register tasks named by the keyword, each scored by the reward in its value; unregistered on exit."""
    for name, reward in task_to_reward.items():
        register_task(RewardOnlyTask(name, reward))
    try:
        yield
    finally:
        for name in task_to_reward:
            TASKS.pop(name, None)


def _await_chain(task: asyncio.Task[Any]) -> str:
    """Where a pending task is suspended: its coroutine's await chain, innermost last."""
    lines, awaited = [repr(task)], task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        else:
            lines.append(f"  awaiting {awaited!r}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return "\n".join(lines)


async def bounded(awaitable: Awaitable[Any], what: str, timeout_s: float = 30.0) -> Any:
    """Await with a limit; past it, fail with every pending task's await chain instead of hanging the session."""
    future = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({future}, timeout=timeout_s)
    if not done:
        chains = "\n".join(_await_chain(task) for task in asyncio.all_tasks() if not task.done())
        future.cancel()
        raise AssertionError(f"{what} did not finish in {timeout_s}s; pending tasks:\n{chains}")
    return future.result()


async def cancel(task: asyncio.Task[Any]) -> None:
    """Cancel until done: on Python 3.11, redis-py's zero-timeout readability check can swallow a cancel."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)


@contextlib.asynccontextmanager
async def started(backend: RewardBackend) -> AsyncIterator[RewardBackend]:
    """`async with backend`, with a bounded close."""
    await bounded(backend.start(), f"starting the {backend.name} backend")
    try:
        yield backend
    finally:
        await bounded(backend.close(), f"closing the {backend.name} backend")


@contextlib.asynccontextmanager
async def running_router(redis_url: str, job_id: str, backends: Mapping[str, RewardBackend],
                         **kwargs: Any) -> AsyncIterator[tuple[RedisBus, RewardRouter]]:
    """A router on its own task; cancelled and its bus closed on exit."""
    bus = RedisBus(redis_url, job_id, claim_idle_ms=2000)
    kwargs.setdefault("default_backend", next(iter(backends)))
    router = RewardRouter(bus, backends, detokenize, limits=limits_under_test(), task_rewards=registered_rewards(),
                          consumer="r0", block_ms=100,
                          metrics_every_s=0.0, **kwargs)
    await bus.ensure_group(TRAJ_RAW.name, TRAJ_RAW.group)
    runner = asyncio.create_task(router.run())
    try:
        yield bus, router
        assert not runner.done() or runner.cancelled(), runner.exception()
    finally:
        await bounded(cancel(runner), "stopping the router")
        await bounded(bus.close(), "closing the bus")


async def wait_scored(bus: RedisBus, num_expected: int, timeout_s: float, grace_s: float = 1.0) -> list[ScoredEvent]:
    """All Scored events once `num_expected` exist, after `grace_s` more (would a duplicate show up late?)."""
    async def scored_all() -> bool:
        return await bus.redis.xlen(bus.key(TRAJ_SCORED.name)) >= num_expected

    await wait_until_async(scored_all, f"{num_expected} scored events", timeout_s)
    await asyncio.sleep(grace_s)
    _, scored = await bus.tail(TRAJ_SCORED.name, block_ms=0, count=10_000)
    assert all(isinstance(e, ScoredEvent) for e in scored)
    return scored


def by_traj_id(scored: list[ScoredEvent]) -> dict[str, ScoredEvent]:
    """Scored events keyed by traj_id, asserting each traj_id was scored exactly once."""
    ids = [e.trajectory.traj_id for e in scored]
    assert len(ids) == len(set(ids)), f"a traj_id was scored twice: {sorted(ids)}"
    return {e.trajectory.traj_id: e for e in scored}
