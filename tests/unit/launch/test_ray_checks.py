"""The Ray launcher's pieces that need no cluster: the backlog autoscaling policy and the up-front checks."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from jetroll.services.launch.ray import WANTED_REPLICAS, backlog_policy, run_ray_job
from jetroll.shared.config.job import load_config
from jetroll.shared.errors import ConfigError

pytestmark = pytest.mark.integration


def test_backlog_policy_takes_the_largest_ask() -> None:
    ctx = SimpleNamespace(aggregated_metrics={WANTED_REPLICAS: {"r1": 2.2, "r2": 1.0}}, current_num_replicas=1)
    assert backlog_policy(ctx) == (3, {})


def test_backlog_policy_keeps_the_count_without_reports() -> None:
    for metrics in (None, {}, {WANTED_REPLICAS: {}}):
        assert backlog_policy(SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=2)) == (2, {})


def test_missing_ray_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert run_ray_job(load_config()) == 2
    assert capsys.readouterr().err.strip() == "jetroll: the ray launcher needs Ray: pip install 'jetroll[ray]'"


def test_ray_address_needs_a_reachable_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="--redis-url or set redis.url"):
        run_ray_job(load_config(), ray_address="127.0.0.1:6379")
    with pytest.raises(ConfigError, match="cannot reach Redis at redis://127.0.0.1:1/0"):
        run_ray_job(load_config(), redis_url="redis://127.0.0.1:1/0", ray_address="127.0.0.1:6379")
