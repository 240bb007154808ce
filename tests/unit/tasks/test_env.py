"""The environment API: per-call timeout with one retry and a failure status, and the built-in calculator tool."""

from __future__ import annotations

import asyncio
import time

import pytest

from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.calculator import CalculatorEnv
from jetroll.shared.tasks.env import Environment, EnvStep, call_env, is_multi_turn
from jetroll.shared.tasks.registry import TASKS


class Flaky:
    """Fails (hangs or raises) its first `num_failures` calls, then answers."""

    def __init__(self, num_failures: int, hang: bool) -> None:
        self.num_failures, self.hang, self.num_calls = num_failures, hang, 0

    async def __call__(self) -> EnvStep:
        self.num_calls += 1
        if self.num_calls <= self.num_failures:
            if self.hang:
                await asyncio.sleep(60)
            raise RuntimeError("tool crashed")
        return EnvStep(observation="= 1\n")


@pytest.mark.parametrize("hang", [True, False])
def test_one_retry_recovers_a_single_failure(hang: bool) -> None:
    call = Flaky(1, hang)
    outcome = asyncio.run(call_env(call, timeout_s=0.1))
    assert outcome.status == "ok" and outcome.attempts == 2 and outcome.value == EnvStep(observation="= 1\n")


@pytest.mark.parametrize(("hang", "status"), [(True, "timeout"), (False, "error")])
def test_a_second_failure_is_final_with_its_status(hang: bool, status: str) -> None:
    call = Flaky(2, hang)
    started = time.monotonic()
    outcome = asyncio.run(call_env(call, timeout_s=0.1))
    assert outcome.status == status and outcome.value is None and outcome.attempts == 2 and call.num_calls == 2
    assert ("RuntimeError: tool crashed" in outcome.error) != hang
    assert time.monotonic() - started < 1.0  # two timeouts of 0.1 s, not the 60 s hang


def test_retries_are_configurable() -> None:
    assert asyncio.run(call_env(Flaky(1, False), timeout_s=1, max_retries=0)).status == "error"
    outcome = asyncio.run(call_env(Flaky(3, False), timeout_s=1, max_retries=3))
    assert outcome.status == "ok" and outcome.attempts == 4


def test_calculator_env_answers_calls_then_takes_the_final_answer() -> None:
    async def episode(turns: list[str], max_calls: int = 2) -> list[EnvStep]:
        env = CalculatorEnv(max_calls=max_calls)
        assert isinstance(env, Environment)
        await env.reset(Problem("347*829=", "287663"))
        return [await env.step(turn) for turn in turns]

    assert asyncio.run(episode(["call 347*829", "287663"])) == [
        EnvStep(observation="= 287663\n"), EnvStep(done=True, reward=1.0)]
    assert asyncio.run(episode(["call 12+5", "call 3-40", "17"])) == [
        EnvStep(observation="= 17\n"), EnvStep(observation="= -37\n"), EnvStep(done=True, reward=0.0)]
    assert asyncio.run(episode(["287000"])) == [EnvStep(done=True, reward=0.0)]
    assert asyncio.run(episode(["call 347*"])) == [EnvStep(done=True, reward=0.0)]  # malformed: a final answer
    # past max_calls a call ends the episode
    assert asyncio.run(episode(["call 1*2", "call 1*2"], max_calls=1))[1] == EnvStep(done=True, reward=0.0)


def test_calculator_is_a_registered_multi_turn_task() -> None:
    task = TASKS["calculator"]
    assert is_multi_turn(task) and not is_multi_turn(TASKS["arithmetic"])
    assert isinstance(task.make_env(), CalculatorEnv) and task.make_env() is not task.make_env()
