"""Reward backends by name. The remote ones import their clients (Celery, aioboto3) only when built."""

from __future__ import annotations

from jetroll.services.reward.backends.base import RewardBackend
from jetroll.services.reward.backends.inline import InlineBackend
from jetroll.services.reward.backends.local import LocalBackend
from jetroll.services.reward.pool import RewardPool
from jetroll.shared.config.reward import RewardConfig
from jetroll.shared.protocol.topology import job_key

BACKENDS = ("local", "inline", "celery", "lambda")


def setup_backend(name: str, config: RewardConfig, *, redis_url: str, job_id: str) -> RewardBackend:
    """Build backend `name` from the reward config; `redis_url` is the job's Redis (idempotency records)."""
    if name == "local":
        return LocalBackend(RewardPool(config.num_workers, config.timeout_s, config.modules))
    if name == "inline":
        return InlineBackend(config.timeout_s, config.modules)
    if name == "celery":
        from jetroll.services.reward.backends.celery import CeleryBackend

        return CeleryBackend(
            config.celery_broker_url or redis_url,
            key_prefix=job_key(job_id, "reward:celery"),
            queue=config.celery_queue,
            concurrency=config.celery_concurrency,
            soft_time_limit_s=config.timeout_s,
            hard_time_limit_s=config.celery_hard_time_limit_s,
            visibility_timeout_s=config.celery_visibility_timeout_s,
        )
    if name == "lambda":
        from jetroll.services.reward.backends.lambda_ import LambdaBackend

        return LambdaBackend(
            redis_url,
            key_prefix=job_key(job_id, "reward:lambda"),
            default_function=config.lambda_function,
            functions=config.lambda_functions,
            endpoint_url=config.lambda_endpoint_url,
            region=config.lambda_region,
            read_timeout_s=config.lambda_read_s,
            concurrency=config.lambda_concurrency,
        )
    raise ValueError(f"unknown reward backend {name!r}; valid: {', '.join(BACKENDS)}")


def backends_in_use(config: RewardConfig, tasks: list[str]) -> list[str]:
    """The backends that score at least one of `tasks`, in BACKENDS order."""
    used = {config.backend_of(task) for task in tasks}
    return [name for name in BACKENDS if name in used]


def needs_celery_worker(config: RewardConfig, tasks: list[str]) -> bool:
    return config.celery_start_worker and "celery" in backends_in_use(config, tasks)
