"""The checks every consumer runs on an event that decodes (shared/protocol/validate.py): each names what is wrong."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from factories import trajectory as make_trajectory

from jetroll.shared.config.job import validate_config
from jetroll.shared.protocol.dead_letters import dead_letter_counts
from jetroll.shared.protocol.events import (
    Array,
    GroupEvent,
    MetricsEvent,
    ScoredEvent,
    TrajectoryEvent,
    WeightsPublishedEvent,
)
from jetroll.shared.protocol.validate import (
    EventLimits,
    check_group,
    check_metrics,
    check_scored,
    check_trajectory,
    check_weights,
    expecting,
)
from jetroll.shared.tasks.registry import TaskSet

LIMITS = EventLimits(vocab_rows=40, group_size=4, max_seq_len=16, max_new_tokens=8, max_version=10,
                     tasks=frozenset({"arithmetic"}), pools=frozenset({"default"}))
URI = "file:///store/j/weights/v00000003/manifest.json"


def group(**fields: Any) -> GroupEvent:
    event = GroupEvent(job_id="j", group_id="g1", task="arithmetic", pool="default", prompt="1+2=",
                       prompt_ids=Array.of([5, 6, 7, 8], "<i4"), answer="3", group_size=4, max_new_tokens=8, v_adm=2)
    return msgspec.structs.replace(event, **fields)


def trajectory(**fields: Any) -> TrajectoryEvent:
    event = make_trajectory("g1:2", [9, 1], prompt="1+2=", answer="3", behavior_logprobs=[-0.5, -0.1], v_tok=[2, 3],
                            v_adm=2, group_size=4)
    return msgspec.structs.replace(event, **fields)


def test_valid_events_pass() -> None:
    assert check_group(group(), LIMITS) is None
    assert check_trajectory(trajectory(), LIMITS) is None
    assert check_trajectory(trajectory(), LIMITS, newest_version=3) is None
    scored = ScoredEvent(job_id="j", trajectory=trajectory(), reward=0.5, status="ok", attempts=1, backend="local",
                         latency_s=0.0)
    assert check_scored(scored, LIMITS) is None
    weights = WeightsPublishedEvent(job_id="j", version=3, step=3, manifest_uri=URI, shard_sha256={"a": "0" * 64},
                                    size_bytes=10, precision_id="p")
    assert check_weights(weights, LIMITS, URI) is None
    assert check_metrics(MetricsEvent(job_id="j", service="trainer", values={"loss": 1.0}, step=3), LIMITS) is None


@pytest.mark.parametrize(("fields", "reason"), [
    ({"prompt_ids": Array.of([5, 40], "<i4")}, "prompt_ids holds token ids outside 0..39"),
    ({"prompt_ids": Array.of([-1], "<i4")}, "prompt_ids holds token ids outside"),
    ({"prompt_ids": Array.of([], "<i4")}, "prompt_ids has 0 tokens"),
    ({"prompt_ids": Array.of([1] * 16, "<i4")}, "prompt_ids has 16 tokens, outside 1..15"),
    ({"prompt_ids": Array.of([1.0], "<f4")}, "1-D integer array"),
    ({"group_size": 10**6}, "group_size 1000000 is not the job's 4"),
    ({"task": "other"}, "task 'other' is not one of the job's tasks"),
    ({"pool": "gpu"}, "pool 'gpu' is not one of the job's pools"),
    ({"max_new_tokens": 9}, "max_new_tokens 9 is outside 1..8"),
    ({"v_adm": 11}, "v_adm 11 is outside 0..10"),
    ({"min_version": -1}, "min_version -1 is outside 0..10"),
])
def test_bad_groups_name_the_problem(fields: dict[str, Any], reason: str) -> None:
    assert reason in (check_group(group(**fields), LIMITS) or "")


@pytest.mark.parametrize(("fields", "reason"), [
    ({"completion_ids": Array.of([9, 40], "<i4")}, "completion_ids holds token ids outside 0..39"),
    ({"completion_ids": Array.of([1] * 13, "<i4")}, "completion_ids has 13 tokens, outside 1..12"),
    ({"loss_mask": Array.of([1], "<u1")}, "loss_mask has shape (1,), the completion has 2 tokens"),
    ({"v_tok": Array.of([2, 3, 3], "<i4")}, "v_tok has shape (3,)"),
    ({"loss_mask": Array.of([1, 2], "<u1")}, "loss_mask holds values other than 0 and 1"),
    ({"loss_mask": Array.of([0, 0], "<u1")}, "no policy token"),
    ({"behavior_logprobs": Array.of([float("nan"), -0.1], "<f4")}, "behavior_logprobs must be finite"),
    ({"behavior_logprobs": Array.of([float("-inf"), -0.1], "<f4")}, "behavior_logprobs must be finite"),
    ({"behavior_logprobs": Array.of([0.5, -0.1], "<f4")}, "(<= 0)"),
    ({"v_tok": Array.of([2, 11], "<i4")}, "v_tok spans versions 2..11, outside 0..10"),
    ({"v_tok": Array.of([-1, 2], "<i4")}, "v_tok spans versions -1..2"),
    ({"sample": 4}, "sample 4 is outside 0..3"),
    ({"traj_id": "g1:3"}, "traj_id 'g1:3' is not group_id:sample (g1:2)"),
    ({"temperature": float("nan")}, "temperature nan is not a positive number"),
    ({"top_p": 0.0}, "top_p 0.0 is outside (0, 1]"),
    ({"v_adm": 12}, "v_adm 12 is outside 0..10"),
    ({**{name: Array.of([], dtype) for name, dtype in (("completion_ids", "<i4"), ("loss_mask", "<u1"),
                                                        ("behavior_logprobs", "<f4"), ("v_tok", "<i4"))}},
     "completion_ids has 0 tokens, outside 1..12"),
])
def test_bad_trajectories_name_the_problem(fields: dict[str, Any], reason: str) -> None:
    assert reason in (check_trajectory(trajectory(**fields), LIMITS) or "")


@pytest.mark.parametrize("status", ["timeout", "error"])
def test_an_episode_whose_environment_never_reset_has_no_tokens_and_still_passes(status: str) -> None:
    """It is emitted so its group completes and is dropped: refused, it would hold the trainer at the staleness
    bound for good."""
    empty = {name: Array.of([], dtype) for name, dtype in (("completion_ids", "<i4"), ("loss_mask", "<u1"),
                                                            ("behavior_logprobs", "<f4"), ("v_tok", "<i4"))}
    assert check_trajectory(trajectory(env_status=status, **empty), LIMITS) is None
    scored = ScoredEvent(job_id="j", trajectory=trajectory(env_status=status, **empty), reward=None,
                         status="env_fail", attempts=0, backend="local", latency_s=0.0)
    assert check_scored(scored, LIMITS) is None


def test_a_version_newer_than_the_consumers_own_is_from_the_future() -> None:
    """The trainer passes its own version: a token of version 3 cannot exist while it is at 2."""
    assert "outside 0..2" in (check_trajectory(trajectory(), LIMITS, newest_version=2) or "")


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -0.1, 1.5])
def test_rewards_outside_the_unit_interval_are_refused(reward: float) -> None:
    scored = ScoredEvent(job_id="j", trajectory=trajectory(), reward=reward, status="ok", attempts=1,
                         backend="local", latency_s=0.0)
    assert "is outside [0, 1]" in (check_scored(scored, LIMITS) or "")


@pytest.mark.parametrize(("fields", "reason"), [
    ({"version": 11}, "version 11 is outside 0..10"),
    ({"manifest_uri": "file:///etc/passwd"}, "is not this job's store"),
    ({"shard_sha256": {}}, "without shards"),
])
def test_bad_announcements_name_the_problem(fields: dict[str, Any], reason: str) -> None:
    weights = WeightsPublishedEvent(job_id="j", version=3, step=3, manifest_uri=URI, shard_sha256={"a": "0" * 64},
                                    size_bytes=10, precision_id="p")
    assert reason in (check_weights(msgspec.structs.replace(weights, **fields), LIMITS, URI) or "")


def test_attempts_count_reward_calls_and_a_failed_environment_makes_none() -> None:
    def scored(status: str, attempts: int) -> ScoredEvent:
        return ScoredEvent(job_id="j", trajectory=trajectory(), reward=0.5 if status == "ok" else None,
                           status=status, attempts=attempts, backend="local", latency_s=0.0)  # type: ignore[arg-type]

    assert check_scored(scored("env_fail", 0), LIMITS) is None
    assert "attempts 0 < 1 for status 'ok'" in (check_scored(scored("ok", 0), LIMITS) or "")
    assert "attempts -1 < 0" in (check_scored(scored("env_fail", -1), LIMITS) or "")


def test_only_the_trainers_metric_steps_are_versions() -> None:
    def metric(service: str, step: int) -> MetricsEvent:
        return MetricsEvent(job_id="j", service=service, values={"x": float("nan")}, step=step)

    assert check_metrics(metric("reward", 187), LIMITS) is None  # the router counts samples scored
    assert "step 11 of a trainer metric is outside 0..10" in (check_metrics(metric("trainer", 11), LIMITS) or "")
    assert "outside" in (check_metrics(metric("reward", -1), LIMITS) or "")
    for values in ({}, {"": 1.0}):
        event = MetricsEvent(job_id="j", service="trainer", values=values, step=1)
        assert check_metrics(event, LIMITS) == "a metrics event without a service, values or a name"


def test_expecting_refuses_other_kinds() -> None:
    check = expecting(GroupEvent, lambda event: check_group(event, LIMITS))
    assert asyncio.run(check(group())) is None
    assert asyncio.run(check(trajectory())) == "expected a GroupEvent, got a TrajectoryEvent"


def test_dead_letters_count_by_stream_and_kind_of_reason() -> None:
    records = [{"stream": "traj:raw", "reason": "invalid TrajectoryEvent: v_tok spans versions 7..9, outside 0..4"},
               {"stream": "traj:raw", "reason": "invalid TrajectoryEvent: v_tok spans versions 8..8, outside 0..4"},
               {"stream": "groups:default", "reason": "invalid GroupEvent: task 'x' is not one of ..."},
               {"stream": "groups:default", "reason": "invalid GroupEvent: task 'y' is not one of ..."},
               {"stream": "weights", "reason": "undecodable event: ..."}]
    assert dead_letter_counts(records) == {
        "traj:raw: invalid TrajectoryEvent: v_tok spans versions N..N, outside N..N": 2,
        "groups:default: invalid GroupEvent: task '…' is not one of ...": 2,
        "weights: undecodable event: ...": 1}


def test_limits_follow_the_config_and_the_timing_engine_draws_past_the_window() -> None:
    real = EventLimits.of(validate_config({"job_id": "j", "rollout": {"max_seq_len": 48}}), TaskSet(), 40)
    assert (real.max_seq_len, real.group_size, real.tasks, real.pools) == (48, 8, {"arithmetic"}, {"default"})
    assert real.max_new_tokens == 8  # the arithmetic task's budget
    timing = validate_config({"job_id": "j", "rollout": {"engine": "timing", "max_seq_len": 48,
                                                         "timing": {"max_tokens": 4096}}})
    assert EventLimits.of(timing, TaskSet(), 40).max_seq_len == 48 + 4096
