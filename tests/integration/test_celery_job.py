"""End to end: `jetroll run configs/smoke.yaml --set reward.backend=celery` with the Celery worker it launches."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from job_harness import (
    audit_ledger,
    celery_worker_pids,
    check_summary,
    hold_streams,
    launch,
    scored_events,
    service_logs,
    stop,
)

from jetroll.services.launch.redis_server import RedisServer
from jetroll.shared.protocol.events import ScoredEvent

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_smoke_job_with_celery_rewards(tmp_path: Path, redis_url: str, model_path: str) -> None:  # noqa: F811
    job_id = f"t{uuid.uuid4().hex[:8]}"
    hold_streams(redis_url, job_id, "traj:scored")
    job = launch(tmp_path, redis_url, model_path, "reward.backend=celery", "reward.celery_concurrency=2",
                 job_id=job_id)
    try:
        assert job.wait() == 0, f"{job.stderr()}\n{service_logs(job.run_dir)}"
        check_summary(job, max_steps=4)
        audit_ledger(redis_url, job.job_id, max_steps=4, groups_per_step=4, group_size=4)
        scored = scored_events(redis_url, job.job_id)
        assert len(scored) >= 4 * 4 * 4 and all(isinstance(e, ScoredEvent) for e in scored)
        assert {(e.backend, e.status) for e in scored} == {("celery", "ok")}
        assert "jetroll.reward" in job.service_log("celery-worker")
        assert not celery_worker_pids(job.job_id), "the launcher left Celery processes behind"
    finally:
        stop(job)


def test_a_separate_broker_down_longer_than_the_reward_timeout_loses_no_reward(
        tmp_path: Path, redis_url: str, model_path: str) -> None:  # noqa: F811
    """The Celery broker (a Redis of its own, persisting to a file) SIGKILLed mid-job, and back on its port once the
    outage has hit both sides (the Celery worker died of it, reward calls found it unreachable) and has outlasted
    reward.timeout_s: calls wait for it and send again, so every trajectory is scored `ok` by Celery, none as an
    error or 0."""
    job_id = f"t{uuid.uuid4().hex[:8]}"
    hold_streams(redis_url, job_id, "traj:scored")
    broker = RedisServer(data_dir=tmp_path / "broker").start()
    max_steps = 6
    job = launch(tmp_path, redis_url, model_path, "reward.backend=celery", f"reward.celery_broker_url={broker.url}",
                 f"trainer.max_steps={max_steps}", job_id=job_id)
    try:
        job.wait_until(lambda: len(job.metrics()) >= 2, "2 steps")
        assert broker._proc is not None
        os.kill(broker._proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait_until(lambda: " died " in job.stderr(), "the Celery worker's death")
        job.wait_until(lambda: "Celery broker unreachable" in job.service_log("reward"), "a reward call on the outage")
        timeout_s = json.loads(job.config_path.read_text())["reward"]["timeout_s"]
        time.sleep(max(0.0, timeout_s + 1.0 - (time.monotonic() - killed_at)))  # the outage outlasts a call's limit
        broker.restart()
        assert job.wait() == 0, job.report()
    finally:
        stop(job)
        broker.stop()
    # only the Celery worker dies: it stops cold on the lost broker (ExitOnBrokerLoss), and the launcher restarts it
    deaths = [line for line in job.stderr().splitlines() if " died " in line]
    assert deaths, "the Celery worker outlived its broker"
    assert all("service celery-worker died (exit 1)" in line and "restart" in line for line in deaths), deaths
    assert "lost the broker" in job.service_log("celery-worker")
    audit_ledger(redis_url, job_id, max_steps=max_steps, groups_per_step=4, group_size=4)
    assert {(e.backend, e.status) for e in scored_events(redis_url, job_id)} == {("celery", "ok")}
    assert "Celery broker unreachable" in job.service_log("reward")  # the outage really hit reward calls
