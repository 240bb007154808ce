"""Test-only rewards for the remote runners, imported by Celery workers and Lambda environments by module name."""

from __future__ import annotations

import os
import time

from jetroll.functions.registry import RewardOutput, reward


@reward("test_pid_sleep")
def pid_sleep_reward(completion: str, answer: str) -> RewardOutput:
    """Appends this process's pid to the file `answer`, then sleeps `float(completion)` seconds and scores 1."""
    with open(answer, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(float(completion))
    return RewardOutput(reward=1.0, correct=True)


@reward("test_stubborn")
def stubborn_reward(completion: str, answer: str) -> RewardOutput:
    """Sleeps `float(completion)` seconds, swallowing Celery's soft time limit: only the hard limit stops it."""
    deadline = time.monotonic() + float(completion)
    while time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except BaseException:  # deliberately swallows SoftTimeLimitExceeded
            pass
    return RewardOutput(reward=1.0, correct=True)
