"""`tasks[].env_faults`: any multi-turn task's environment made slow and flaky on purpose (`FlakyEnv`)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from jetroll.shared.config.job import validate_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.env import EnvFault, EnvStep, FlakyEnv, call_env


class CountingEnv:
    def __init__(self) -> None:
        self.resets = self.steps = 0

    async def reset(self, problem: Problem) -> None:
        self.resets += 1

    async def step(self, turn: str) -> EnvStep:
        self.steps += 1
        return EnvStep(observation=f"= {turn}\n")


def test_failures_come_at_the_configured_rate_before_the_environment_sees_the_call() -> None:
    inner = CountingEnv()
    env = FlakyEnv(inner, 0.0, 0.2, random.Random(0))

    async def calls() -> int:
        failed = 0
        for i in range(2000):
            try:
                assert await env.step(str(i)) == EnvStep(observation=f"= {i}\n")
            except EnvFault:
                failed += 1
        return failed

    failed = asyncio.run(calls())
    assert 320 <= failed <= 480  # 400 expected; 4.5 standard deviations either side
    assert inner.steps == 2000 - failed  # a failed call never reached the environment: retrying it is safe
    same = FlakyEnv(CountingEnv(), 0.0, 0.2, random.Random(0))
    assert asyncio.run(_outcomes(same)) == asyncio.run(_outcomes(FlakyEnv(CountingEnv(), 0.0, 0.2, random.Random(0))))


async def _outcomes(env: FlakyEnv) -> list[str]:
    return [(await call_env(lambda: env.step("1"), timeout_s=1.0, max_retries=0)).status for _ in range(50)]


def test_every_call_waits_its_delay_and_a_failure_is_retried_as_any_environment_failure() -> None:
    env = FlakyEnv(CountingEnv(), 0.05, 0.0, random.Random(0))
    started = time.perf_counter()
    asyncio.run(env.reset(Problem("1*2=", "2")))
    assert time.perf_counter() - started >= 0.05
    always = FlakyEnv(CountingEnv(), 0.0, 0.999, random.Random(0))
    outcome = asyncio.run(call_env(lambda: always.step("x"), timeout_s=1.0, max_retries=1))
    assert outcome.status == "error" and outcome.attempts == 2 and "injected step failure" in outcome.error


def test_env_faults_belong_to_tasks_with_an_environment() -> None:
    config = validate_config({"tasks": [{"name": "calculator", "env_faults": {"delay_s": 0.2, "failure_rate": 0.05}},
                                        {"name": "arithmetic"}]})
    faults = config.env_faults("calculator")
    assert faults is not None and (faults.delay_s, faults.failure_rate) == (0.2, 0.05)
    assert config.env_faults("arithmetic") is None
    with pytest.raises(ConfigError, match="tasks.0.env_faults: task 'arithmetic' has no environment to make flaky"):
        validate_config({"tasks": [{"name": "arithmetic", "env_faults": {"failure_rate": 0.5}}]})
    with pytest.raises(ConfigError, match="failure_rate"):
        validate_config({"tasks": [{"name": "calculator", "env_faults": {"failure_rate": 1.0}}]})
