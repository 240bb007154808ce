"""Test-only rewards, imported by RewardPool workers via `modules=("reward_test_fns",)`."""

from __future__ import annotations

import os
import time

from jetroll.functions.registry import RewardOutput, reward


@reward("test_sleep")
def sleep_reward(completion: str, answer: str) -> RewardOutput:
    """Sleeps `float(completion)` seconds, then scores 1."""
    time.sleep(float(completion))
    return RewardOutput(reward=1.0, correct=True)


@reward("test_raise")
def raise_reward(completion: str, answer: str) -> RewardOutput:
    raise RuntimeError(f"boom: {completion}")


@reward("test_exit")
def exit_reward(completion: str, answer: str) -> RewardOutput:
    os._exit(3)


@reward("test_pid")
def pid_reward(completion: str, answer: str) -> RewardOutput:
    """Reports the worker's pid through `reward`-free means: correct iff the pid equals `answer`."""
    return RewardOutput(reward=0.0, correct=str(os.getpid()) == answer)


@reward("test_bad_type")
def bad_type_reward(completion: str, answer: str) -> RewardOutput:
    return 1.0  # type: ignore[return-value]
