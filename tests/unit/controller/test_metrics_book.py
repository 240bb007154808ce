"""The controller's metrics book: one metrics.jsonl row per trainer step, with what the other services report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetroll.services.controller.progress import MetricsBook
from jetroll.shared.protocol.events import MetricsEvent


def rollout(worker: str, pool: str, values: dict[str, float]) -> MetricsEvent:
    return MetricsEvent(job_id="j", service=worker, values={f"pool/{pool}/{k}": v for k, v in values.items()}, step=0)


def test_a_pools_environment_counts_are_totalled_over_its_workers_and_its_setup_share_is_per_episode(
        tmp_path: Path) -> None:
    book = MetricsBook(tmp_path)
    # two workers of one pool: 3 and 1 ended episodes, with set-up shares summing to 1.5 and 0.9
    book.add(rollout("rollout-tools-0", "tools", {"env_fail/error": 1, "env_failed_calls/error": 4,
                                                  "env_episodes/ok": 3, "env_setup_share_sum/ok": 1.5}))
    book.add(rollout("rollout-tools-1", "tools", {"env_failed_calls/timeout": 2, "env_episodes/ok": 1,
                                                  "env_setup_share_sum/ok": 0.9, "env_episodes/failed": 1,
                                                  "env_setup_share_sum/failed": 0.8}))
    book.add(rollout("rollout-lake-0", "lake", {"num_trajectories": 16, "env_episodes/ok": 16,
                                                "env_setup_share_sum/ok": 0.16}))
    row = book.add(MetricsEvent(job_id="j", service="trainer", values={"loss": 0.1}, step=1))
    assert row is not None
    assert row["pool/tools/env_fail/error"] == 1
    assert row["pool/tools/env_failed_calls/error"] == 4 and row["pool/tools/env_failed_calls/timeout"] == 2
    assert row["pool/tools/env_episodes/ok"] == 4 and row["pool/tools/env_episodes/failed"] == 1
    assert row["pool/tools/env_setup_share/ok"] == pytest.approx(2.4 / 4)  # per episode, not per worker
    assert row["pool/tools/env_setup_share/failed"] == pytest.approx(0.8)
    assert row["pool/lake/env_setup_share/ok"] == pytest.approx(0.01) and row["pool/lake/num_trajectories"] == 16
    assert "pool/tools/env_setup_share_sum/ok" not in row  # the sums are the book's inputs, not a column
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["pool/tools/env_episodes/ok"] == 4
