"""Reward backend config (per-task selection, limit rules) and the validation of outcomes that crossed a wire."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetroll.services.reward.backends import backends_in_use, needs_celery_worker, setup_backend
from jetroll.services.reward.backends.base import Outcome
from jetroll.shared.config.job import load_config
from jetroll.shared.config.reward import RewardConfig
from jetroll.shared.errors import ConfigError

pytestmark = pytest.mark.integration

SMOKE = Path(__file__).resolve().parents[3] / "configs" / "smoke.yaml"


def test_backend_per_task() -> None:
    config = load_config(SMOKE, ["reward.backend=celery", "reward.task_backends={count: lambda}"]).reward
    assert config.backend_of("arithmetic") == "celery" and config.backend_of("count") == "lambda"
    assert backends_in_use(config, ["arithmetic", "count"]) == ["celery", "lambda"]
    assert backends_in_use(config, ["count"]) == ["lambda"]
    assert needs_celery_worker(config, ["arithmetic"]) and not needs_celery_worker(config, ["count"])
    assert load_config(SMOKE).reward.backend_of("arithmetic") == "local"


@pytest.mark.parametrize(("override", "message"), [
    ("reward.backend=ray", "reward.backend"),
    ("reward.task_backends={nope: local}", "unknown task 'nope'"),
    ("reward.celery_visibility_timeout_s=12", "celery_visibility_timeout_s must exceed"),
    ("reward.lambda_read_timeout_s=3", "lambda_read_timeout_s must exceed"),
])
def test_bad_reward_config_is_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config(SMOKE, ["reward.timeout_s=5", "reward.celery_hard_grace_s=7", override])
    assert "\n" not in str(err.value)


def test_limits_derived_from_timeout() -> None:
    config = RewardConfig(timeout_s=4.0, celery_hard_grace_s=2.0)
    assert config.celery_hard_time_limit_s == 6.0 and config.lambda_read_s == 14.0
    assert RewardConfig(timeout_s=4.0, lambda_read_timeout_s=5.0).lambda_read_s == 5.0


def test_unknown_backend_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="local, inline, celery, lambda"):
        setup_backend("ray", RewardConfig(), redis_url="redis://127.0.0.1:1/0", job_id="j")


@pytest.mark.parametrize("reply", [
    None, [], {"status": "maybe"}, {"status": "ok"}, {"status": "ok", "reward": float("nan")},
    {"status": "ok", "reward": 1.5}, {"status": "ok", "reward": True}, {"status": "ok", "reward": "1"},
])
def test_malformed_replies_are_errors_never_rewards(reply: object) -> None:
    outcome = Outcome.from_reply(reply)
    assert outcome.status == "error" and outcome.reward is None


def test_replies() -> None:
    assert Outcome.from_reply({"status": "ok", "reward": 1, "correct": True}) == Outcome("ok", 1.0, True)
    assert Outcome.from_reply({"status": "timeout", "detail": "soft"}) == Outcome("timeout", detail="soft")
