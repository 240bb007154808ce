"""Multi-turn environments: the async API a task's episodes run against.

An episode: `reset(problem)` once, then `step(turn)` on every model turn (the text the model wrote since the last
observation, without the turn-end character). A step returns the observation to append to the trajectory (those
tokens get loss_mask 0), whether the episode is done, and optionally the environment's own reward. The task's
reward function still scores the whole transcript; the environment's reward is recorded beside it.

Every reset and step runs under a timeout with `max_retries` retries (one by default), so a step must be safe to
repeat on the same state. What still fails is the trajectory's `env_status` (`timeout` or `error`): the reward
router records `env_fail` and the trainer drops the group, counted by status.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, runtime_checkable

from jetroll.shared.tasks.base import Problem, Task

EnvStatus = Literal["ok", "timeout", "error"]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EnvStep:
    """What one step returns. `observation` ends with the task's turn end unless it is empty; it is ignored when
    `done` (no model turn follows it)."""

    observation: str = ""
    done: bool = False
    reward: float | None = None  # the environment's own reward, usually only on the final step
    observation_ids: list[int] | None = None  # a token environment's (shared/engine/turns.py), as ids


@runtime_checkable
class Environment(Protocol):
    """One episode's state. Methods are coroutines: an environment that computes must offload (asyncio.to_thread),
    so the rollout worker's loop keeps decoding the other sequences while it waits."""

    async def reset(self, problem: Problem) -> None:
        """Start an episode on a task's problem (the prompt is the problem's)."""
        ...

    async def step(self, turn: str) -> EnvStep:
        """React to one model turn."""
        ...


@runtime_checkable
class MultiTurnTask(Protocol):
    """A task whose episodes alternate model turns and environment observations."""

    turn_end: str  # one vocabulary character: a model turn ends with it (or with EOS, the final turn)

    def make_env(self) -> Environment:
        """A fresh environment for one episode."""
        ...

    def sft_turns(self, problem: Problem) -> list[tuple[str, str]]:
        """The supervised warm start's transcript: (model turn, observation) pairs; the last observation is ""."""
        ...


def is_multi_turn(task: Task) -> bool:
    return isinstance(task, MultiTurnTask)


@dataclass(frozen=True, slots=True)
class EnvOutcome:
    """A reset or step after its retries: the value when `status` is ok, else None."""

    status: EnvStatus
    value: object = None
    attempts: int = 1
    error: str = ""
    failures: tuple[EnvStatus, ...] = ()  # each failed attempt's status, retried ones included


async def call_env(call: Callable[[], Awaitable[T]], timeout_s: float, max_retries: int = 1) -> EnvOutcome:
    """`call()` under a per-attempt timeout, retried `max_retries` times on a timeout or an exception."""
    failures: list[EnvStatus] = []
    error = ""
    for attempt in range(1, max_retries + 2):
        try:
            return EnvOutcome("ok", await asyncio.wait_for(call(), timeout_s), attempt, failures=tuple(failures))
        except TimeoutError:
            failures.append("timeout")
            error = f"no answer within {timeout_s} s"
        except Exception as exc:  # an environment's failure is a status on its trajectory, never a lost worker
            failures.append("error")
            error = f"{type(exc).__name__}: {exc}"
    return EnvOutcome(failures[-1], None, max_retries + 1, error, tuple(failures))


class EnvFault(RuntimeError):
    """A failure injected on purpose (`EnvFaults`)."""


class FlakyEnv:
    """An environment made slow and flaky on purpose, for any multi-turn task (`tasks[].env_faults`): every reset and
    step first waits `delay_s`, then fails with probability `failure_rate` before the wrapped environment sees it, so
    a retried call is safe. `rng` decides the failures: seeded per episode, a run's faults repeat."""

    def __init__(self, env: Environment, delay_s: float, failure_rate: float, rng: random.Random) -> None:
        self.env = env
        self.delay_s = delay_s
        self.failure_rate = failure_rate
        self.rng = rng

    async def _fault(self, call: str) -> None:
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        if self.rng.random() < self.failure_rate:
            raise EnvFault(f"an injected {call} failure (env_faults.failure_rate {self.failure_rate:g})")

    async def reset(self, problem: Problem) -> None:
        await self._fault("reset")
        await self.env.reset(problem)

    async def step(self, turn: str) -> EnvStep:
        await self._fault("step")
        return await self.env.step(turn)
