"""reward: the router, its backends and their limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from jetroll.shared.schema import Strict

RewardBackendName = Literal["local", "inline", "celery", "lambda"]


class RewardConfig(Strict):
    """The reward router: scores each task's reward on a backend (local pool, inline, Celery or AWS Lambda) and owns
    retries: throttling with backoff, a timeout or error `max_retries` times on local, inline and celery, never on
    lambda."""

    backend: RewardBackendName = Field("local", description="backend of every task not in task_backends: local (a "
                                       "process pool: a call that overruns timeout_s is killed), inline (in the "
                                       "router's process, for cheap rewards the job trusts: no process hop, no "
                                       "isolation), celery or lambda")
    task_backends: dict[str, RewardBackendName] = Field(
        default_factory=dict, description="per-task backend overrides, e.g. {code: lambda}")
    modules: list[str] = Field(default_factory=list, description="extra modules whose @reward functions the local "
                               "pool and a launched Celery worker import (remote runners: JETROLL_REWARD_MODULES)")
    num_workers: int = Field(1, ge=1, description="local backend: pool processes (its concurrency limit)")
    timeout_s: float = Field(10.0, gt=0, description="per-call limit: local kills the worker, inline counts a call "
                             "past it as a timeout once it returns, celery's soft time limit, lambda's function "
                             "timeout")
    max_retries: int = Field(1, ge=0, description="retries of a timeout or error on local, inline and celery; lambda "
                             "never retries them (the handler may have run)")
    max_throttle_retries: int = Field(5, ge=0, description="retries of a throttled call (429) before `throttled` "
                                      "is final")
    throttle_backoff_s: float = Field(0.2, gt=0, description="first backoff after a throttle; doubles, with jitter")
    celery_broker_url: str | None = Field(None, description="Celery Redis broker; None uses the job's Redis")
    celery_queue: str = Field("jetroll.reward", min_length=1, description="Celery queue of reward tasks")
    celery_concurrency: int = Field(4, ge=1, description="celery: tasks in flight, and the launched worker's "
                                    "prefork processes")
    celery_hard_grace_s: float = Field(5.0, gt=0, description="celery hard time limit = timeout_s + this")
    celery_visibility_timeout_s: float = Field(300.0, gt=0, description="broker redelivers a task unacked this "
                                               "long (its worker died); must exceed the hard limit")
    celery_start_worker: bool = Field(True, description="`jetroll run` starts a Celery worker when a task uses "
                                      "celery (false: bring your own on celery_broker_url)")
    lambda_function: str = Field("jetroll-reward", min_length=1, description="Lambda function for rewards not in "
                                 "lambda_functions")
    lambda_functions: dict[str, str] = Field(default_factory=dict, description="reward name -> function name/ARN")
    lambda_endpoint_url: str | None = Field(None, description="Lambda API endpoint (local server); None is AWS")
    lambda_region: str = Field("us-east-1", description="AWS region of the functions")
    lambda_concurrency: int = Field(32, ge=1, description="lambda: invocations in flight")
    lambda_read_timeout_s: float | None = Field(None, gt=0, description="HTTP read timeout; None is timeout_s + "
                                                "10. Above the function timeout, so a client timeout never "
                                                "re-runs a handler")
    threads: int = Field(1, ge=1, description="torch threads for the router process")

    @model_validator(mode="after")
    def _limits(self) -> RewardConfig:
        if self.celery_visibility_timeout_s <= self.celery_hard_time_limit_s:
            raise ValueError("reward.celery_visibility_timeout_s must exceed reward.timeout_s + "
                             f"reward.celery_hard_grace_s ({self.celery_hard_time_limit_s}s)")
        if self.lambda_read_timeout_s is not None and self.lambda_read_timeout_s <= self.timeout_s:
            raise ValueError("reward.lambda_read_timeout_s must exceed reward.timeout_s (the function timeout)")
        return self

    @property
    def celery_hard_time_limit_s(self) -> float:
        return self.timeout_s + self.celery_hard_grace_s

    @property
    def lambda_read_s(self) -> float:
        return self.lambda_read_timeout_s if self.lambda_read_timeout_s is not None else self.timeout_s + 10.0

    def backend_of(self, task: str) -> str:
        """The backend that scores `task`."""
        return self.task_backends.get(task, self.backend)
