"""Hardware-affinity pools on the real services: each task's groups go to its pool's stream and workers, and slowing
one pool 5x leaves the other task's trained throughput where it was (no head-of-line blocking)."""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from job_harness import hold_streams, read_ledger
from service_harness import TINY, build_model

from jetroll.services.launch.local import Launcher
from jetroll.shared.config.job import validate_config
from jetroll.shared.protocol.bus import FIELD
from jetroll.shared.protocol.events import GroupEvent, TrajectoryEvent, decode

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, WARMUP, GROUPS, GROUP_SIZE = 24, 4, 4, 4
TOKENS, TOKEN_TIME_S, TRAIN_S = 32, 0.003, 0.2  # a trajectory takes ~0.1 s, 5x slowed ~0.5 s: within eta_hard steps


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="jetroll-affinity-model-") as tmp:
        build_model(Path(tmp), seed=0)
        yield Path(tmp)


def run(model_dir: Path, root: Path, redis_url: str, slow_factor: float, fail_frac: float = 0.0) -> dict[str, Any]:
    job_id = f"aff{uuid.uuid4().hex[:8]}"
    timing = {"mean_tokens": TOKENS, "cv": 0.0, "token_time_s": TOKEN_TIME_S, "fail_frac": fail_frac}
    tree = {
        "job_id": job_id,
        "model": {**TINY.model_dump(), "path": str(model_dir)},
        "tasks": [{"name": "arithmetic"}, {"name": "count"}],
        "rollout": {"engine": "timing", "compile": False, "max_batch": 32, "timing": timing, "pools": [
            {"name": "fast", "labels": {"hw": "a"}, "tasks": ["arithmetic"]},
            {"name": "slow", "labels": {"hw": "b"}, "tasks": ["count"],
             "timing": {**timing, "token_time_s": TOKEN_TIME_S * slow_factor}},
        ]},
        "reward": {"num_workers": 2},
        "trainer": {"engine": "timing", "timing_step_s": TRAIN_S, "max_steps": STEPS, "groups_per_step": GROUPS,
                    "group_size": GROUP_SIZE, "checkpoint_every": STEPS},
        "store": {"root": str(root / "store"), "keep_last": 2},
        "eval": {"num_problems": 1},
    }
    root.mkdir(parents=True)
    hold_streams(redis_url, job_id, "groups:fast", "groups:slow", "traj:raw")
    launcher = Launcher(validate_config(tree), root, redis_url, is_console=False)
    try:
        assert launcher.supervise() == 0, f"the job failed; see {root / 'logs'}"
    finally:
        launcher.stop()
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    first, window = rows[WARMUP - 1], rows[WARMUP:]
    window_s = window[-1]["time_s"] - first["time_s"]
    client = redis.Redis.from_url(redis_url)
    try:
        groups = {pool: [decode(fields[FIELD]) for _, fields in client.xrange(f"jetroll:{job_id}:groups:{pool}")]
                  for pool in ("fast", "slow")}
        trajectories = [decode(fields[FIELD]) for _, fields in client.xrange(f"jetroll:{job_id}:traj:raw")]
    finally:
        client.close()
    summary = json.loads((root / "summary.json").read_text())
    assert summary["dead_letters"] == {}, summary["dead_letters"]  # no check refused one of the job's own events
    return {
        "per_s": {task: sum(r[f"groups/{task}"] for r in window) * GROUP_SIZE / window_s
                  for task in ("arithmetic", "count")},
        "groups": groups, "trajectories": trajectories, "last": rows[-1],
        "summary": summary, "job_id": job_id,
    }


def test_pools_route_by_task_and_a_slow_pool_blocks_no_one(model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    base = run(model_dir, tmp_path / "base", redis_url, slow_factor=1.0)
    slowed = run(model_dir, tmp_path / "slowed", redis_url, slow_factor=5.0)
    for result in (base, slowed):
        # routing: each pool's stream holds only its task, and its workers emitted only that task
        assert {g.task for g in result["groups"]["fast"] if isinstance(g, GroupEvent)} == {"arithmetic"}
        assert {g.task for g in result["groups"]["slow"] if isinstance(g, GroupEvent)} == {"count"}
        by_pool = {(t.pool, t.task, t.worker.split("-")[1]) for t in result["trajectories"]
                   if isinstance(t, TrajectoryEvent)}
        assert by_pool == {("fast", "arithmetic", "fast"), ("slow", "count", "slow")}, by_pool
        # per-pool metrics reach the controller's rows
        assert result["last"]["pool/fast/num_trajectories"] > 0 and result["last"]["pool/slow/num_trajectories"] > 0
    # the slowdown is real: the slow pool's token rate fell about 5x
    ratio_slow = slowed["last"]["pool/slow/tokens_per_s"] / base["last"]["pool/slow/tokens_per_s"]
    assert ratio_slow < 0.4, ratio_slow
    kept = slowed["per_s"]["arithmetic"] / base["per_s"]["arithmetic"]
    print(f"arithmetic trained trajectories/s: base {base['per_s']['arithmetic']:.1f}, with the count pool 5x slower "
          f"{slowed['per_s']['arithmetic']:.1f} ({kept:.2f}x); count {base['per_s']['count']:.1f} -> "
          f"{slowed['per_s']['count']:.1f}")
    assert kept >= 0.8, (base["per_s"], slowed["per_s"])


def test_failing_environments_are_all_counted(model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """5% of environments fail (and take 10x longer): the job completes and every failed group is counted by status."""
    result = run(model_dir, tmp_path / "fail", redis_url, slow_factor=1.0, fail_frac=0.05)
    failed_groups = {t.group_id for t in result["trajectories"]
                     if isinstance(t, TrajectoryEvent) and t.env_status != "ok"}
    summary = result["summary"]
    _, ledger, _ = read_ledger(redis_url, result["job_id"])
    dropped = {g for g, outcome in ledger.items() if outcome.status != "trained"}
    assert summary["steps"] == STEPS and dropped
    # every dropped group is counted under its status, and each one had a failed environment
    assert {outcome.status for g, outcome in ledger.items() if g in dropped} == {"dropped:env_fail"}
    assert summary["dropped_by_status"] == {"env_fail": len(dropped)} and summary["groups_dropped"] == len(dropped)
    assert dropped <= failed_groups
    # a failed group not in the ledger was still being scored when the job reached max_steps
    assert len(failed_groups - dropped) <= 2, (len(failed_groups), len(dropped))
