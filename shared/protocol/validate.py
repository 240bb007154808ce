"""What an event must mean before a consumer acts on it: the checks past decoding.

An event can decode and still make no sense: a token id past the embedding, arrays of different lengths, a NaN
log-prob, a version from the future, a group of a million samples, an empty prompt. Every consumer runs its
event's check first and dead-letters the entry with the reason it returns; None means the event may be used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from jetroll.shared.config.job import JobConfig
from jetroll.shared.protocol.bus import EventCheck
from jetroll.shared.protocol.events import (
    AnyEvent,
    Array,
    EpisodeEvent,
    GroupEvent,
    MetricsEvent,
    ScoredEvent,
    TrajectoryEvent,
    WeightsPublishedEvent,
)
from jetroll.shared.tasks.registry import TaskSet

INTEGER_DTYPES = frozenset({"<i4", "<i8"})
E = TypeVar("E")


def expecting(kind: type[E], check: Callable[[E], str | None]) -> EventCheck:
    """The bus's check for a stream that carries events of `kind` only."""
    async def run(event: AnyEvent) -> str | None:
        if not isinstance(event, kind):
            return f"expected a {kind.__name__}, got a {type(event).__name__}"
        return check(event)

    return run


@dataclass(frozen=True, slots=True)
class EventLimits:
    """What the job's config and model allow; a consumer builds it once."""

    vocab_rows: int  # every token id is below this: the embedding's rows (or what the consumer's tokenizer reads)
    group_size: int  # the samples of every group (trainer.group_size)
    max_seq_len: int  # prompt + completion tokens (rollout.max_seq_len)
    max_new_tokens: int  # the largest sample budget of any of the job's tasks
    max_version: int  # the last weight version of the job (trainer.max_steps)
    tasks: frozenset[str]
    pools: frozenset[str]

    @classmethod
    def of(cls, config: JobConfig, tasks: TaskSet, vocab_rows: int) -> EventLimits:
        rollout = config.rollout
        return cls(vocab_rows=vocab_rows, group_size=config.trainer.group_size,
                   max_seq_len=rollout.max_trajectory_tokens(),
                   max_new_tokens=max(rollout.sample_budget(tasks[t.name].max_new_tokens) for t in config.tasks),
                   max_version=config.trainer.max_steps, tasks=frozenset(t.name for t in config.tasks),
                   pools=frozenset(pool.name for pool in rollout.pools))


def check_group(event: GroupEvent, limits: EventLimits) -> str | None:
    """A rollout worker's work item."""
    return (_check_header(event.task, event.pool, event.group_size, limits)
            or _check_ids("prompt_ids", event.prompt_ids, limits, min_len=1, max_len=limits.max_seq_len - 1)
            or _check_range("max_new_tokens", event.max_new_tokens, 1, limits.max_new_tokens)
            or _check_range("v_adm", event.v_adm, 0, limits.max_version)
            or _check_range("min_version", event.min_version, 0, limits.max_version))


def check_episode(event: EpisodeEvent, limits: EventLimits) -> str | None:
    """An environment worker's work item: a task and pool of the job, and a session URL on http."""
    if problem := _check_task_and_pool(event.task, event.pool, limits):
        return problem
    if not (event.url.startswith("http://") or event.url.startswith("https://")) or not event.url.endswith(
            f"/sessions/{event.session_id}/v1"):
        return f"url {event.url!r} is not an http URL of session {event.session_id!r}"
    return None


def check_trajectory(event: TrajectoryEvent, limits: EventLimits, newest_version: int | None = None) -> str | None:
    """One finished sample. `newest_version`, when the consumer knows it, bounds every version the event names."""
    newest = limits.max_version if newest_version is None else min(newest_version, limits.max_version)
    reason = (_check_header(event.task, event.pool, event.group_size, limits)
              or _check_range("sample", event.sample, 0, limits.group_size - 1)
              or _check_ids("prompt_ids", event.prompt_ids, limits, min_len=1, max_len=limits.max_seq_len - 1)
              # an episode whose environment failed to reset never sampled: its group is dropped, not trained
              or _check_ids("completion_ids", event.completion_ids, limits, min_len=int(event.env_status == "ok"),
                            max_len=limits.max_seq_len - event.prompt_ids.shape[0]))
    if reason:
        return reason
    if event.traj_id != f"{event.group_id}:{event.sample}":
        return f"traj_id {event.traj_id!r} is not group_id:sample ({event.group_id}:{event.sample})"
    n = event.completion_ids.shape[0]
    for name, array in (("loss_mask", event.loss_mask), ("behavior_logprobs", event.behavior_logprobs),
                        ("v_tok", event.v_tok)):
        if array.shape != (n,):
            return f"{name} has shape {array.shape}, the completion has {n} tokens"
    mask = event.loss_mask.numpy()
    if ((mask != 0) & (mask != 1)).any():  # not np.isin: 15x slower on a trajectory's few tokens
        return "loss_mask holds values other than 0 and 1"
    if n and not mask.any():
        return "loss_mask marks no policy token"
    logprobs = event.behavior_logprobs.numpy()
    if event.behavior_logprobs.dtype != "<f4" or not np.isfinite(logprobs).all() or (logprobs > 1e-4).any():
        return "behavior_logprobs must be finite fp32 log-probabilities (<= 0)"
    if event.v_tok.dtype not in INTEGER_DTYPES:
        return f"v_tok has dtype {event.v_tok.dtype}, not an integer"
    versions = event.v_tok.numpy()
    if n and (versions.min() < 0 or versions.max() > newest):
        return f"v_tok spans versions {versions.min()}..{versions.max()}, outside 0..{newest}"
    if not 0 <= event.v_adm <= newest:
        return f"v_adm {event.v_adm} is outside 0..{newest}"
    if not (math.isfinite(event.temperature) and event.temperature > 0):
        return f"temperature {event.temperature} is not a positive number"
    if not 0 < event.top_p <= 1:
        return f"top_p {event.top_p} is outside (0, 1]"
    return None


def check_scored(event: ScoredEvent, limits: EventLimits, newest_version: int | None = None) -> str | None:
    """A scored sample: its trajectory, and a reward in [0, 1] when there is one."""
    if event.reward is not None and not (math.isfinite(event.reward) and 0.0 <= event.reward <= 1.0):
        return f"reward {event.reward} is outside [0, 1]"
    least = 0 if event.status == "env_fail" else 1  # a failed environment is never scored: no call was made
    if event.attempts < least:
        return f"attempts {event.attempts} < {least} for status {event.status!r}"
    return check_trajectory(event.trajectory, limits, newest_version)


def check_weights(event: WeightsPublishedEvent, limits: EventLimits, manifest_uri: str) -> str | None:
    """A weights announcement, before the store is asked: a version of this job, and its manifest in this job's
    store (`manifest_uri`: where the store keeps that version's manifest)."""
    if not 0 <= event.version <= limits.max_version:
        return f"version {event.version} is outside 0..{limits.max_version}"
    if event.manifest_uri != manifest_uri:
        return f"manifest_uri {event.manifest_uri!r} is not this job's store ({manifest_uri!r})"
    if event.size_bytes < 0 or not event.shard_sha256:
        return "an announcement without shards"
    return None


def check_metrics(event: MetricsEvent, limits: EventLimits) -> str | None:
    """A metric: the trainer's `step` is its version, which rows are keyed by; another service's counts what it
    likes (the reward router: samples scored)."""
    if not event.service or not event.values or not all(event.values):
        return "a metrics event without a service, values or a name"
    high = limits.max_version if event.service == "trainer" else None
    if event.step < 0 or high is not None and event.step > high:
        return f"step {event.step} of a {event.service} metric is outside 0..{high if high is not None else ''}"
    return None


def _check_task_and_pool(task: str, pool: str, limits: EventLimits) -> str | None:
    if task not in limits.tasks:
        return f"task {task!r} is not one of the job's tasks {sorted(limits.tasks)}"
    if pool not in limits.pools:
        return f"pool {pool!r} is not one of the job's pools {sorted(limits.pools)}"
    return None


def _check_header(task: str, pool: str, group_size: int, limits: EventLimits) -> str | None:
    if problem := _check_task_and_pool(task, pool, limits):
        return problem
    if group_size != limits.group_size:
        return f"group_size {group_size} is not the job's {limits.group_size}"
    return None


def _check_range(name: str, value: int, low: int, high: int) -> str | None:
    return None if low <= value <= high else f"{name} {value} is outside {low}..{high}"


def _check_ids(name: str, ids: Array, limits: EventLimits, *, min_len: int, max_len: int) -> str | None:
    if ids.dtype not in INTEGER_DTYPES or len(ids.shape) != 1:
        return f"{name} must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}"
    if not min_len <= ids.shape[0] <= max_len:
        return f"{name} has {ids.shape[0]} tokens, outside {min_len}..{max_len}"
    values = ids.numpy()
    if values.size and (values.min() < 0 or values.max() >= limits.vocab_rows):
        return f"{name} holds token ids outside 0..{limits.vocab_rows - 1}"
    return None
