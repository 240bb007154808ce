"""Reproducible runs: a group's problem is a pure function of the job seed and its admission index, so a restarted
controller draws what the first one would have; in sync mode with one rollout worker, two runs of one config give the
same metrics step by step and the same weights, bit for bit."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from job_harness import Job, launch, service_logs, stop
from service_harness import TINY, build_model

from jetroll.functions.scoring import job_tasks
from jetroll.services.controller.controller import Controller
from jetroll.shared.config.job import validate_config
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import GroupEvent, decode
from jetroll.shared.store import setup_store

pytestmark = pytest.mark.integration

# metrics.jsonl columns that measure wall time, or that sample another service's running counter at the moment the
# controller writes the row (the rollout's trajectory count): everything else must repeat exactly
TIMING_COLUMNS = frozenset({
    "time_s", "step_time_s", "stage_s", "commit_wait_s", "trainer_wait_s", "trainer_idle_frac", "stale_wait_s",
    "mismatch_wait_s", "mismatch_sample_s", "rollout_busy_slot_s", "rollout_slot_s", "rollout_idle_frac",
    "rollout_tokens_per_s",
    "pool/default/tokens_per_s", "pool/default/num_trajectories",
})
# summary.json fields of the same kinds, and Redis's memory, whose stream sizes hold the timing metrics until trimmed
TIMING_SUMMARY = frozenset({"job_id", "wall_time_s", "rollout_tokens_per_s", "redis_memory"})


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="jetroll-repro-model-") as tmp:
        build_model(Path(tmp), seed=0)
        yield Path(tmp)


def test_a_restarted_controller_draws_the_same_problems(model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """B = 4, eta = 2: version 0 admits 12 groups, version 1 four more. A controller restarted between the two draws
    groups 13-16 as one that admitted them in one life, in other batches; another job seed draws other problems."""

    def controller(job_id: str, seed: int) -> Controller:
        config = validate_config({"job_id": job_id, "seed": seed,
                                  "model": {**TINY.model_dump(), "path": str(model_dir)},
                                  "trainer": {"groups_per_step": 4, "group_size": 2, "max_steps": 10},
                                  "store": {"root": str(tmp_path / job_id)}})
        bus = RedisBus(redis_url, job_id)
        run_dir = tmp_path / job_id
        return Controller(config, job_tasks(config), bus, setup_store(config.store, job_id, run_dir), run_dir)

    async def admit(job_id: str, seed: int, lives: list[list[int]]) -> None:
        """Controller lives one after another: each restores the admitted count from Redis, then admits once at each
        of its versions."""
        for versions in lives:
            life = controller(job_id, seed)
            try:
                await life._restore_admitted()
                for version in versions:
                    life.version = version
                    await life._admit()
            finally:
                await life.bus.close()

    async def groups(job_id: str) -> list[tuple[str, str, str]]:
        bus = RedisBus(redis_url, job_id)
        try:
            events = [decode(fields[b"e"]) for _, fields in await bus.redis.xrange(bus.key("groups:default"))]
        finally:
            await bus.close()
        assert all(isinstance(e, GroupEvent) for e in events)
        return [(e.group_id, e.prompt, e.answer) for e in events]

    async def scenario() -> tuple[list[tuple[str, str, str]], ...]:
        restarted, at_once, other_seed = (f"p{uuid.uuid4().hex[:8]}" for _ in range(3))
        await admit(restarted, seed=3, lives=[[0], [1]])
        # one life at version 1: its first admission stops at the 12-group in-flight cap, the next admits the rest
        await admit(at_once, seed=3, lives=[[1, 1]])
        await admit(other_seed, seed=4, lives=[[1, 1]])
        return await groups(restarted), await groups(at_once), await groups(other_seed)

    restarted, at_once, other_seed = asyncio.run(scenario())
    assert [g for g, _, _ in restarted] == [f"g{i:07d}" for i in range(1, 17)]
    assert restarted == at_once
    assert [g for g, _, _ in other_seed] == [g for g, _, _ in at_once]
    assert sum(a != b for a, b in zip(other_seed, at_once, strict=True)) >= 14  # a few may coincide by chance
    assert len({prompt for _, prompt, _ in at_once}) >= 14  # the groups differ from each other too


def without(row: dict, names: frozenset[str]) -> dict:
    """`row` less `names`, with NaN (an empty statistic) made comparable."""
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items() if k not in names}


def weights_sha256(job: Job) -> dict[str, str]:
    """sha256 of every stored weight version's and checkpoint's safetensors file, by path below the job's store."""
    root = job.run_dir / "store" / job.job_id
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.safetensors"))}


@pytest.mark.job
def test_two_sync_runs_repeat_every_metric_and_weight(tmp_path: Path, redis_url: str, model_path: str) -> None:  # noqa: F811
    """The smoke config in sync mode, twice at the same time (so their timings differ): the same non-timing metrics
    at every step, the same evaluations and summary, and bitwise the same weights at every version."""
    jobs = [launch(tmp_path, redis_url, model_path, "staleness.mode=sync") for _ in range(2)]
    try:
        for job in jobs:
            assert job.wait() == 0, f"{job.stderr()}\n{service_logs(job.run_dir)}"
    finally:
        for job in jobs:
            stop(job)
    first, second = jobs
    rows = [[without(row, TIMING_COLUMNS) for row in job.metrics()] for job in jobs]
    assert [row["step"] for row in rows[0]] == [1, 2, 3, 4]
    assert rows[0][0]["num_policy_tokens"] > 0 and any(row["grad_rows_frac"] > 0 for row in rows[0])
    for step, (a, b) in enumerate(zip(*rows, strict=True), start=1):
        assert a == b, f"step {step}: {sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))}"
    assert (first.run_dir / "eval.jsonl").read_text() == (second.run_dir / "eval.jsonl").read_text()
    summaries = [without(json.loads((job.run_dir / "summary.json").read_text()), TIMING_SUMMARY) for job in jobs]
    assert summaries[0] == summaries[1]
    weights = [weights_sha256(job) for job in jobs]
    assert "weights/v00000004/model.safetensors" in weights[0] and weights[0] == weights[1]


@pytest.mark.slow
def test_a_sync_run_killed_everywhere_ends_with_the_weights_of_a_fault_free_one(
    tmp_path: Path, redis_url: str, model_path: str  # noqa: F811
) -> None:
    """Sync mode, one rollout worker, FP8 on the exact backend: SIGKILL the trainer twice, the rollout worker, the
    reward router and the controller at seeded steps, beside the same job with no faults. Every restarted service
    replays what its predecessor would have done, so the final weights agree bit for bit."""
    from job_harness import kill_service

    args = ("staleness.mode=sync", "precision.mode=fp8_unified", "precision.backend=exact", "trainer.max_steps=8")
    clean, faulty = (launch(tmp_path, redis_url, model_path, *args) for _ in range(2))
    rng = random.Random(20261202)
    schedule = sorted((rng.randint(1, 6), kind) for kind in ("trainer", "trainer", "rollout", "reward", "controller"))
    try:
        killed: dict[str, int | None] = {}
        for num_kills, (step, kind) in enumerate(schedule, start=1):
            faulty.wait_until(lambda n=step: len(faulty.metrics()) >= n, f"step {step}")
            killed[kind] = kill_service(faulty, kind, not_pid=killed.get(kind))
            faulty.wait_until(lambda n=num_kills: faulty.stderr().count("died (exit -9)") >= n, f"kill {num_kills}")
        for job in (clean, faulty):
            assert job.wait() == 0, job.report()
    finally:
        for job in (clean, faulty):
            stop(job)
    assert faulty.stderr().count("died (exit -9)") == len(schedule), faulty.stderr()
    weights = [weights_sha256(job) for job in (clean, faulty)]
    final = "weights/v00000008/model.safetensors"
    assert final in weights[0] and weights[0][final] == weights[1][final], schedule
    common = weights[0].keys() & weights[1].keys()
    assert {k: weights[0][k] for k in common} == {k: weights[1][k] for k in common}
