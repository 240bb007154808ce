"""The reward router against a real Redis: scoring, dedupe on traj_id, and timeout -> final status after a retry."""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from factories import trajectory
from helpers import ended, wait_until_async
from reward_harness import cancel, detokenize, limits_under_test, registered_rewards, traj, wait_scored
from service_harness import job_config

from jetroll.functions.scoring import job_tasks
from jetroll.services.reward import main as reward_main
from jetroll.services.reward.backends.local import LocalBackend
from jetroll.services.reward.pool import RewardPool
from jetroll.services.reward.router import RewardRouter
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.dead_letters import DeadLetters
from jetroll.shared.protocol.events import ScoredEvent, TrajectoryEvent, decode
from jetroll.shared.protocol.ids import group_id
from jetroll.shared.protocol.ledger import Ledger, Outcome
from jetroll.shared.protocol.topology import SEEN_REWARD, TRAJ_RAW, TRAJ_SCORED
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.registry import TASKS, register_task

UNIT_DIR = str(Path(__file__).parents[1] / "unit" / "reward")
if UNIT_DIR not in sys.path:
    sys.path.insert(0, UNIT_DIR)  # spawned reward workers inherit sys.path and import reward_test_fns

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class SlowTask:
    name: str = "test_slow"
    reward: str = "test_sleep"
    max_new_tokens: int = 4

    def sample(self, rng, index=0):  # pragma: no cover - never sampled here
        return Problem("", "")

    def heldout(self, n):  # pragma: no cover
        return []

    def sft_completion(self, problem):  # pragma: no cover
        return problem.answer


async def route(
    redis_url: str, events: list[TrajectoryEvent], num_expected: int, timeout_s: float, job_id: str = "",
    recorded: tuple[str, ...] = (),
) -> tuple:
    """Publish `events`, run a router until `num_expected` scored events exist (plus a grace period); the groups
    `recorded` are in the trainer's ledger from the start."""
    job_id = job_id or events[0].job_id
    bus = RedisBus(redis_url, job_id)
    pool = RewardPool(num_workers=2, timeout_s=timeout_s, modules=("reward_test_fns",))
    router = RewardRouter(bus, {"local": LocalBackend(pool)}, detokenize, limits=limits_under_test(),
                          task_rewards=registered_rewards(), consumer="r0",
                          max_retries=1, block_ms=100,
                          metrics_every_s=0.0, forget_every_s=0.0)
    try:
        await bus.ensure_group(TRAJ_RAW.name, TRAJ_RAW.group)
        await Ledger(bus).record({g: Outcome(1, "trained", 2) for g in recorded}, keep_groups=0)
        for event in events:
            await bus.publish(TRAJ_RAW.name, event)
        runner = asyncio.create_task(router.run())
        async def scored_all() -> bool:
            return await bus.redis.xlen(bus.key(TRAJ_SCORED.name)) >= num_expected

        await wait_until_async(scored_all, f"{num_expected} scored events", 30, gone=ended(runner))
        await asyncio.sleep(0.5)  # would a duplicate be published late?
        router.stop()
        stopped, _ = await asyncio.wait({runner}, timeout=30)
        assert stopped, "the router did not stop after its current read"
        runner.result()
        _, scored = await bus.tail(TRAJ_SCORED.name, block_ms=0)
        pending = (await bus.redis.xpending(bus.key(TRAJ_RAW.name), TRAJ_RAW.group))["pending"]
        _, metrics = await bus.tail("metrics", block_ms=0)
        seen = sorted(m.decode() for m in await bus.redis.hkeys(bus.key(SEEN_REWARD)))
        return scored, pending, router.counts, metrics, seen
    finally:
        pool.close()
        await bus.close()


async def read_dlq(redis_url: str, job_id: str) -> list[dict[str, str | bytes]]:
    bus = RedisBus(redis_url, job_id)
    try:
        return await DeadLetters(bus).read()
    finally:
        await bus.close()


def test_scores_dedupes_and_acks(redis_url: str) -> None:
    job = uuid.uuid4().hex[:8]
    events = [
        traj(job, "g0:0", "arithmetic", "579", "579"),
        traj(job, "g0:1", "arithmetic", "574", "579"),
        traj(job, "g1:0", "arithmetic", "zz", "-5"),
        traj(job, "g2:0", "count", "11 12 13", "11 12 13"),
        traj(job, "g9:0", "no_such_task", "1", "1"),
        traj(job, "g0:0", "arithmetic", "000", "579"),  # a re-emitted duplicate: dropped
    ]
    scored, pending, counts, metrics, _ = asyncio.run(route(redis_url, events, 4, timeout_s=5.0))
    assert pending == 0
    by_id = {e.trajectory.traj_id: e for e in scored}
    assert len(scored) == 4 and len(by_id) == 4
    assert all(isinstance(e, ScoredEvent) and e.backend == "local" and e.job_id == job for e in scored)
    ok = by_id["g0:0"]
    assert (ok.status, ok.reward, ok.attempts, ok.details) == ("ok", 1.0, 1, {"correct": True})
    assert ok.trajectory.completion_ids.numpy().tolist() == [ord(c) for c in "579"]  # first copy kept
    assert by_id["g0:1"].reward == pytest.approx(0.5 * 2 / 3) and by_id["g0:1"].details == {"correct": False}
    assert by_id["g1:0"].reward == 0.0 and by_id["g1:0"].status == "ok"
    assert by_id["g2:0"].reward == 1.0
    (dead,) = asyncio.run(read_dlq(redis_url, job))  # a task the job does not run is never scored
    assert decode(dead["payload"]).traj_id == "g9:0"
    assert "task 'no_such_task' is not one of the job's tasks" in dead["reason"]
    assert counts["duplicates"] == 1
    names = {name for m in metrics for name in m.values}
    assert names >= {"reward/throughput_per_s", "reward/timeouts", "reward/errors"}


def test_timeout_is_retried_once_then_final(redis_url: str) -> None:
    register_task(SlowTask())
    try:
        job = uuid.uuid4().hex[:8]
        events = [traj(job, "s0:0", "test_slow", "30", ""), traj(job, "s0:1", "arithmetic", "2", "2")]
        scored, pending, counts, _, _ = asyncio.run(route(redis_url, events, 2, timeout_s=0.5))
    finally:
        del TASKS["test_slow"]
    by_id = {e.trajectory.traj_id: e for e in scored}
    slow = by_id["s0:0"]
    assert slow.status == "timeout" and slow.reward is None and slow.attempts == 2
    assert "exceeded" in slow.details["error"] and slow.latency_s >= 1.0
    assert by_id["s0:1"].status == "ok"  # the other worker kept serving
    assert counts["timeout_attempts"] == 2 and pending == 0


def test_redelivery_of_claimed_entry_is_still_scored(redis_url: str) -> None:
    """A router that died after claiming a traj_id but before publishing must not lose it."""
    job = uuid.uuid4().hex[:8]
    event = traj(job, "c0:0", "arithmetic", "7", "7")

    async def crashed_claimant() -> None:
        bus = RedisBus(redis_url, job)
        await bus.ensure_group(TRAJ_RAW.name, TRAJ_RAW.group)
        entry_id = await bus.publish(TRAJ_RAW.name, event)
        await bus.redis.hset(bus.key(SEEN_REWARD), "c0:0", entry_id)
        await bus.close()

    asyncio.run(crashed_claimant())
    scored, pending, counts, _, _ = asyncio.run(route(redis_url, [], 1, timeout_s=5.0, job_id=job))
    assert [(e.trajectory.traj_id, e.status, e.reward) for e in scored] == [("c0:0", "ok", 1.0)]
    assert pending == 0 and counts["duplicates"] == 0


def test_dedupe_marks_of_recorded_groups_are_forgotten(redis_url: str) -> None:
    """The router forgets the traj_ids of groups in the trainer's ledger (g1, folded there: known by its admission
    index alone), and keeps deduping the others."""
    job = uuid.uuid4().hex[:8]
    g1, g2 = group_id(1), group_id(2)
    events = [traj(job, f"{g}:{i}", "arithmetic", "2", "2") for g in (g1, g2) for i in range(2)]
    events.append(traj(job, f"{g2}:0", "arithmetic", "3", "2"))  # a re-emitted duplicate: dropped
    scored, pending, counts, _, seen = asyncio.run(route(redis_url, events, 4, timeout_s=5.0, recorded=(g1,)))
    assert sorted(e.trajectory.traj_id for e in scored) == [f"{g}:{i}" for g in (g1, g2) for i in range(2)]
    assert pending == 0 and counts["duplicates"] == 1
    assert seen == [f"{g2}:0", f"{g2}:1"]


@pytest.mark.parametrize("backend", ["local", "inline"])
def test_the_reward_service_scores_on_the_backend_its_config_names(backend: str, redis_url: str, model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """The reward service as `jetroll run` starts it: reward.backend local scores through a pool process, inline in
    the router's own process (no child at all); both score the same."""
    config = job_config(model_dir, tmp_path, reward={"backend": backend}, trainer={"group_size": 2})
    tokenizer = load_tokenizer(model_dir)
    events = [trajectory(f"g0:{i}", tokenizer.encode(text), job_id=config.job_id, prompt_ids=tokenizer.encode("1+1="),
                         answer="2") for i, text in enumerate(["2", "3"])]

    async def scenario() -> tuple[list[ScoredEvent], int]:
        bus = RedisBus(redis_url, config.job_id)
        service = asyncio.create_task(reward_main.run(config, job_tasks(config), redis_url, str(model_dir), "r0"))
        try:
            await bus.ensure_group(TRAJ_RAW.name, TRAJ_RAW.group)
            await bus.publish_many(TRAJ_RAW.name, events)
            scored = await wait_scored(bus, 2, timeout_s=30, grace_s=0.2)
            return scored, len(multiprocessing.active_children())
        finally:
            await cancel(service)
            await bus.close()

    scored, children = asyncio.run(scenario())
    assert {e.trajectory.traj_id: (e.backend, e.status, e.reward) for e in scored} == {
        "g0:0": (backend, "ok", 1.0), "g0:1": (backend, "ok", 0.0)}
    assert children == (1 if backend == "local" else 0)
