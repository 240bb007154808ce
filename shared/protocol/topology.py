"""Every stream, consumer group and Redis key jetroll uses, in one screen.

A job's names are short: the bus puts them under `jetroll:{job_id}:`. The job queue's names are global.

    stream            event               written by          read by (group)
    groups:{pool}     GroupEvent          controller          rollout workers of the pool ("rollout")
    episodes:{pool}   EpisodeEvent        rollout (gateway)   environment workers of the pool ("env")
    traj:raw          TrajectoryEvent     rollout             reward router ("reward")
    traj:scored       ScoredEvent         reward router       trainer ("trainer")
    weights           WeightsPublished    trainer             rollout, controller (tailed, no group)
    metrics           MetricsEvent        every service       controller (tailed, no group)
    dlq               raw entry + reason  every consumer      people
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stream:
    """A stream read through a consumer group, and the group."""

    name: str
    group: str


def groups_stream(pool: str) -> Stream:
    """A rollout pool's admitted groups: each pool's workers read only their own."""
    return Stream(f"groups:{pool}", "rollout")


def episodes_stream(pool: str) -> Stream:
    """A pool's agent episodes, each to run against its gateway session: the pool's environment workers read them."""
    return Stream(f"episodes:{pool}", "env")


TRAJ_RAW = Stream("traj:raw", "reward")
TRAJ_SCORED = Stream("traj:scored", "trainer")
WEIGHTS = "weights"  # tailed: every reader sees every announcement
METRICS = "metrics"  # tailed by the controller, which trims it
DLQ = "dlq"
DLQ_KEPT = 10_000  # dead letters kept per job (about the newest; XADD MAXLEN ~)

# A job's keys.
NUM_ADMITTED = "num_admitted"  # counter: groups the controller admitted, so a restarted one never reuses an id
IN_FLIGHT = "in_flight"  # sorted set group_id -> oldest version its tokens can carry (in_flight.py)
LEDGER, LEDGER_TOTALS = "ledger", "ledger:totals"  # hashes: outcomes of recorded groups, and totals (ledger.py)
SEEN_REWARD = "seen:reward"  # hash traj_id -> the entry that first carried it, until its group is recorded
REPLICAS = "replicas"  # hash: Ray rollout replica -> the weight version it decodes with
CELERY_RECORDS = "reward:celery"  # prefix of the Celery backend's per-call records
LAMBDA_RECORDS = "reward:lambda"  # prefix of the Lambda backend's per-call records

# The job queue (watch mode): global keys.
JOBS = Stream("jetroll:jobs", "controller")  # submitted JobEvents
ACTIVE = "jetroll:jobs:active"  # JobEvents with the resolved config, one per started job; services tail it
STATUS = "jetroll:jobs:status"  # hash job_id -> JSON status record
JOBS_DLQ = "jetroll:jobs:dlq"  # unprocessable submissions, with the reason
RESERVED_JOB_IDS = frozenset({"jobs"})  # `jetroll:jobs:*` holds the queue, not a job's keys


def job_key(job_id: str, name: str) -> str:
    """The Redis key of one job's stream, hash or set: every job lives under its own prefix."""
    return f"jetroll:{job_id}:{name}"
