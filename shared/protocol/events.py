"""Typed events and the one msgpack codec. Arrays travel as little-endian numpy buffers, never lists."""

from __future__ import annotations

import math
import time
from typing import Any, Literal, get_args

import msgspec
import numpy as np

# 2: a metrics event carries all of one report's values; every other event reads as in 1
SCHEMA_VERSION = 2
SUPPORTED_SCHEMAS = frozenset({1, 2})

ArrayDtype = Literal["<i4", "<f4", "<i8", "<u1"]
ITEMSIZE = {dtype: np.dtype(dtype).itemsize for dtype in get_args(ArrayDtype)}
RewardStatus = Literal["ok", "timeout", "error", "throttled", "env_fail"]


class EventDecodeError(ValueError):
    """Bytes that are not a valid jetroll event; the consumer dead-letters the entry with this message."""


class Array(msgspec.Struct, array_like=True, frozen=True):
    """A numpy array on the wire: dtype string, shape, raw little-endian bytes."""

    dtype: ArrayDtype
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        # plain Python, not numpy: this runs for every array of every event decoded, a few per trajectory
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"array shape {self.shape} has a negative dimension")
        expected = math.prod(self.shape) * ITEMSIZE[self.dtype]
        if len(self.data) != expected:
            raise ValueError(f"array of shape {self.shape} {self.dtype} needs {expected} bytes, got {len(self.data)}")

    @classmethod
    def of(cls, values: Any, dtype: ArrayDtype) -> Array:
        arr = np.ascontiguousarray(np.asarray(values, dtype=np.dtype(dtype)))
        return cls(dtype=dtype, shape=tuple(arr.shape), data=arr.tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class Event(msgspec.Struct, tag_field="kind", kw_only=True):
    schema: int = SCHEMA_VERSION
    job_id: str

    def __post_init__(self) -> None:
        if self.schema not in SUPPORTED_SCHEMAS:
            raise ValueError(f"unsupported schema {self.schema}; this build reads {sorted(SUPPORTED_SCHEMAS)}")


# submit -> controller
class JobEvent(Event, tag="job"):
    config: dict[str, Any]
    submitted_at: float = msgspec.field(default_factory=time.time)


# controller -> rollout (one work item: a prompt sampled group_size times)
class GroupEvent(Event, tag="group"):
    group_id: str
    task: str
    pool: str
    prompt: str
    prompt_ids: Array
    answer: str
    group_size: int
    max_new_tokens: int
    v_adm: int
    min_version: int = 0  # rollout swaps to at least this version before starting the group (sync barrier)


# rollout (its gateway) -> the pool's environment workers (one agent episode to run against a gateway session)
class EpisodeEvent(Event, tag="episode"):
    session_id: str  # "{traj_id}~{gateway incarnation}": a restarted gateway never takes an old agent's requests
    url: str  # the session's OpenAI base URL: {gateway}/sessions/{session_id}/v1
    task: str
    pool: str
    prompt: str
    answer: str


# rollout -> reward router (one event per finished sample)
class TrajectoryEvent(Event, tag="traj"):
    traj_id: str  # "{group_id}:{sample}"
    group_id: str
    sample: int
    task: str
    pool: str
    prompt: str
    answer: str
    prompt_ids: Array
    completion_ids: Array
    loss_mask: Array  # 1 = policy token, 0 = env/tool token
    behavior_logprobs: Array  # mu_t: log_softmax(logits / T) over the full vocab, fp32
    v_tok: Array  # weight version that produced each completion token
    v_adm: int
    group_size: int
    temperature: float
    top_p: float
    precision_id: str
    finish_reason: Literal["stop", "length"]
    env_status: str = "ok"  # multi-turn: ok, or the environment's failure (timeout, error) after its retry
    env_reward: float | None = None  # multi-turn: the environment's own reward, if it gave one (recorded only)
    worker: str = ""
    timings: dict[str, float] = {}


# reward router -> trainer
class ScoredEvent(Event, tag="scored"):
    trajectory: TrajectoryEvent
    reward: float | None  # None unless status == "ok": a failure is never a reward
    status: RewardStatus
    attempts: int
    backend: str
    latency_s: float
    details: dict[str, Any] = {}

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.status == "ok") != (self.reward is not None):
            raise ValueError("a Scored event has a reward exactly when its status is 'ok'")


# trainer -> rollout workers and controller (tailed, no consumer group)
class WeightsPublishedEvent(Event, tag="weights"):
    version: int
    step: int
    manifest_uri: str
    shard_sha256: dict[str, str]
    size_bytes: int
    precision_id: str


# every service -> controller (tailed): one event per report, the trainer's once per step
class MetricsEvent(Event, tag="metrics"):
    service: str
    values: dict[str, float]  # metric name -> value
    step: int
    time: float = msgspec.field(default_factory=time.time)


AnyEvent = (JobEvent | GroupEvent | EpisodeEvent | TrajectoryEvent | ScoredEvent | WeightsPublishedEvent
            | MetricsEvent)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> AnyEvent:
    """Decode and validate; raises EventDecodeError naming what is wrong."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise EventDecodeError(str(exc)) from None
