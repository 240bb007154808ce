"""The rollout worker's config: its pool, its own sections (rollout, and the precision it decodes in), and what it
needs of the others' (the trainer's group size and last version, the tasks' bounds and faults), resolved once at its
entry, so that no part of the worker reads another service's section."""

from __future__ import annotations

from dataclasses import dataclass

from jetroll.shared.config.job import JobConfig
from jetroll.shared.config.launch import RedisConfig
from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.config.rollout import PoolConfig, RolloutConfig
from jetroll.shared.protocol.validate import EventLimits
from jetroll.shared.rl.admission import in_flight_slack
from jetroll.shared.tasks.entry import EnvFaults
from jetroll.shared.tasks.registry import TaskSet


@dataclass(frozen=True)
class RolloutSections:
    job_id: str
    seed: int
    pool: PoolConfig  # the worker's pool (`rollout.pools[]`)
    rollout: RolloutConfig
    precision: PrecisionConfig
    redis: RedisConfig
    weights_poll_s: float  # how often the worker looks for a newer version (store.poll_interval_s)
    group_size: int  # the samples of every group (trainer.group_size)
    in_flight_slack: dict[str, int]  # each task's eta_hard minus the job's (the in-flight index's scores)
    env_faults: dict[str, EnvFaults]  # the tasks whose environments are made slow and flaky on purpose
    limits: EventLimits  # what events may hold; its vocab_rows is the engine's, set once the engine is built

    @classmethod
    def of(cls, config: JobConfig, tasks: TaskSet, pool: str | None = None) -> RolloutSections:
        faults = {entry.name: config.env_faults(entry.name) for entry in config.tasks}
        return cls(
            job_id=config.job_id, seed=config.seed,
            pool=config.rollout.pool(pool) if pool else config.rollout.pools[0],
            rollout=config.rollout, precision=config.precision, redis=config.redis,
            weights_poll_s=config.store.poll_interval_s, group_size=config.trainer.group_size,
            in_flight_slack=in_flight_slack(config),
            env_faults={name: found for name, found in faults.items() if found is not None},
            limits=EventLimits.of(config, tasks, vocab_rows=0))
