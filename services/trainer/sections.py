"""The trainer's config: its own sections of the job, and what it needs of the others' (the tasks', rollout's),
resolved once at its entry, so that no part of the trainer reads another service's section."""

from __future__ import annotations

from dataclasses import dataclass

from jetroll.shared.config.job import JobConfig
from jetroll.shared.config.launch import RedisConfig
from jetroll.shared.config.model import ModelConfig
from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.config.staleness import StalenessConfig
from jetroll.shared.config.store import StoreConfig
from jetroll.shared.config.trainer import TrainerConfig
from jetroll.shared.rl.admission import in_flight_slack, task_quotas
from jetroll.shared.tasks.registry import TaskSet


@dataclass(frozen=True)
class TrainerSections:
    job_id: str
    seed: int
    model: ModelConfig
    trainer: TrainerConfig
    precision: PrecisionConfig
    staleness: StalenessConfig
    store: StoreConfig
    redis: RedisConfig
    task_names: tuple[str, ...]  # the job's tasks, in the config's order
    sample_budgets: dict[str, int]  # each task's tokens a sample may generate (rollout.max_new_tokens caps its own)
    eta_hard: dict[str, int]  # the largest lag a trained token of each task may have
    in_flight_slack: dict[str, int]  # each task's eta_hard minus the job's (the in-flight index's scores)
    task_quotas: dict[str, int] | None  # each task's groups in a step (`trainer.task_quotas`), else None
    pool_engines: dict[str, str]  # each rollout pool's engine, by pool name
    pools_computing_mu: frozenset[str]  # the pools whose engine runs the model (a drawn mu has no mismatch)
    rollout_keeps_kv: bool  # rollout keeps in-flight KV caches across a weight swap (rollout.recompute_kv_on_swap off)

    @classmethod
    def of(cls, config: JobConfig, tasks: TaskSet) -> TrainerSections:
        rollout = config.rollout
        names = tuple(entry.name for entry in config.tasks)
        return cls(
            job_id=config.job_id, seed=config.seed, model=config.model, trainer=config.trainer,
            precision=config.precision, staleness=config.staleness, store=config.store, redis=config.redis,
            task_names=names,
            sample_budgets={name: rollout.sample_budget(tasks[name].max_new_tokens) for name in names},
            eta_hard={name: config.task_eta_hard(name) for name in names},
            in_flight_slack=in_flight_slack(config),
            task_quotas=task_quotas(config) if config.trainer.task_quotas else None,
            pool_engines={pool.name: rollout.engine_of(pool) for pool in rollout.pools},
            pools_computing_mu=frozenset(pool.name for pool in rollout.pools if rollout.runs_model(pool)),
            rollout_keeps_kv=not rollout.recompute_kv_on_swap)

    @property
    def max_eta_hard(self) -> int:
        """The largest lag any trained token may have."""
        return max(self.eta_hard.values())
