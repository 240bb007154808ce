"""tasks[].env_faults: a slow, flaky environment on purpose, for any multi-turn task."""

from __future__ import annotations

from pydantic import Field

from jetroll.shared.config.base import Strict


class EnvFaults(Strict):
    """Faults injected into every episode's environment (`FlakyEnv`, shared/tasks/env.py): each reset and step
    waits `delay_s`, then fails with probability `failure_rate`. The failures are drawn per episode from the job's
    seed and the trajectory's id, so a run's faults repeat."""

    delay_s: float = Field(0.0, ge=0, description="seconds added to every reset and step")
    failure_rate: float = Field(0.0, ge=0, lt=1, description="chance that a reset or step raises (then retried as "
                                "any environment failure is: rollout.env_max_retries)")
