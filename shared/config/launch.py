"""redis and launch: where the bus lives, and how services are started and restarted."""

from __future__ import annotations

from pydantic import Field

from jetroll.shared.schema import Strict


class RedisConfig(Strict):
    url: str | None = Field(None, description="Redis URL; None starts a private redis-server")
    max_deliveries: int = Field(5, ge=1, description="deliveries before an entry goes to the dlq")
    dlq_alarm_min: int = Field(200, ge=1, description="the controller fails the job (exit 65, no restart) once this "
                               "many entries went to the dlq over consecutive 10 s windows, each with fewer samples "
                               "trained or dropped than dead-lettered: a version skew between services dead-letters "
                               "every event, which would otherwise stall the job for good")
    claim_idle_ms: int = Field(30000, ge=100, description="XAUTOCLAIM entries idle this long")
    max_lag: int = Field(2048, ge=1, description="backpressure: producers wait while consumer lag exceeds")
    ledger_keep_groups: int = Field(1024, ge=0, description="outcomes the ledger keeps of groups below its fully "
                                    "recorded prefix, for audits; older groups count only in its totals, which "
                                    "bounds its memory")


class LaunchConfig(Strict):
    max_restarts: int = Field(3, ge=0, description="restarts of a dead service before the job fails")
    trainer_num_cpus: float = Field(1.0, ge=0, description="ray launcher: CPUs reserved for the trainer actor")
    trainer_num_gpus: float = Field(0.0, ge=0, description="ray launcher: GPUs reserved for the trainer actor")
    reward_num_cpus: float = Field(1.0, ge=0, description="ray launcher: CPUs reserved for the reward router actor")
