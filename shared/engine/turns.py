"""Multi-turn episodes beside the engine (the environment API is `shared/tasks/env.py`).

Each multi-turn sequence has its own environment: reset before its prompt is prefilled, stepped on every model
turn (and on the final one, which ends with EOS). Every call is an asyncio task under `timeout_s` with
`max_retries` retries, so the engine keeps decoding the other sequences while one waits; the waiting sequence
holds its slot, paused. Results reach the engine only through `apply`, at a token boundary between engine steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from jetroll.shared.engine.interface import TurnEngine
from jetroll.shared.engine.request import EnvResult, Request, has_room_after
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.env import Environment, EnvOutcome, EnvStep, call_env

log = logging.getLogger("jetroll.rollout")


@runtime_checkable
class TokenEnvironment(Protocol):
    """An environment that speaks token ids, not text: an agent's gateway session (shared/agents/session.py). Its
    reset gives the prompt's ids, its step reads the turn's sampled ids straight from the request, and it hears of
    the episode's end, however it ended, so that it can answer a client still waiting."""

    async def reset(self, problem: Problem) -> list[int]:
        """The episode's prompt ids (they replace the request's)."""
        ...

    async def step_tokens(self, request: Request, turn_start: int) -> EnvStep:
        """React to the turn in `request.output_ids[turn_start:]`; an observation comes as `observation_ids`."""
        ...

    def close(self, request: Request) -> None:
        """The episode ended (its request is finished or its environment failed)."""
        ...


@dataclass(slots=True)
class Episode:
    request: Request
    env: Environment | TokenEnvironment
    turn_start: int = 0  # where the current model turn starts in request.output_ids
    is_started: bool = False  # reset succeeded and the request went to the engine
    status: str = "ok"  # the environment's, once a call failed after its retries
    reward: float | None = None  # the environment's own, from its latest step that gave one
    started_at: float = 0.0  # monotonic, when its reset was asked for
    setup_s: float = 0.0  # its reset's time, retries included


@dataclass(slots=True)
class EnvCounts:
    """What a runner's environments did, for the rollout worker's metrics: failed calls by status (each attempt,
    retried or not), and the set-up share of each ended episode (its reset's time over its whole time) summed by
    how the episode ended (`ok`, or `failed` when a call failed after its retries)."""

    failed_calls: Counter[str]
    setup_share_sum: Counter[str]
    episodes: Counter[str]


class TurnRunner:
    def __init__(self, engine: TurnEngine, tokenizer: Tokenizer, timeout_s: float, max_retries: int = 1) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.episodes: dict[str, Episode] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.ready: list[tuple[Episode, str, EnvOutcome]] = []  # (episode, "reset" | "step", outcome)
        self.env_results: dict[str, EnvResult] = {}  # episodes that ended, until `env_result` takes theirs
        self.counts = EnvCounts(Counter(), Counter(), Counter())
        self.wakeup = asyncio.Event()

    @property
    def num_pending(self) -> int:
        """Environment calls in flight or finished but not yet applied."""
        return len(self.tasks) + len(self.ready)

    @property
    def num_resetting(self) -> int:
        """Episodes whose request is not in the engine yet: they will need a slot."""
        return sum(not e.is_started for e in self.episodes.values())

    def start(self, request: Request, env: Environment | TokenEnvironment, problem: Problem) -> None:
        """Reset a new episode; its request joins the engine once the reset succeeds (with the prompt a token
        environment's reset gives)."""
        assert request.turn_end_id is not None, "a multi-turn request needs its turn-end token"
        episode = self.episodes[request.request_id] = Episode(request, env, started_at=time.monotonic())
        self._spawn(episode, "reset", lambda: env.reset(problem))

    def on_step(self, requests: list[Request]) -> list[Request]:
        """Route what `engine.step` returned: an episode's turn goes to its environment; returns the requests that
        are done now (single-turn ones, and episodes cut off by the length limit)."""
        done = []
        for request in requests:
            episode = self.episodes.get(request.request_id)
            if episode is None:
                done.append(request)
            elif request.finish_reason == "length":
                self._end(episode)
                done.append(request)
            elif isinstance(episode.env, TokenEnvironment):
                self._spawn(episode, "step", lambda env=episode.env, request=request, start=episode.turn_start:
                            env.step_tokens(request, start))
            else:
                turn_ids = request.output_ids[episode.turn_start :]
                turn = self.tokenizer.decode(turn_ids).removesuffix(self.tokenizer.decode([request.turn_end_id]))
                self._spawn(episode, "step", lambda env=episode.env, turn=turn: env.step(turn))
        return done

    def apply(self) -> list[Request]:
        """Hand finished environment calls to the engine (call only between engine steps); returns the requests
        whose episodes ended."""
        ended = []
        ready, self.ready = self.ready, []
        self.wakeup.clear()
        for episode, kind, outcome in ready:
            request = episode.request
            observation_ids = None
            if outcome.status == "ok" and kind == "step":
                observation_ids, outcome = self._observation(episode, outcome)
            if outcome.status != "ok":
                log.warning("environment %s of %s failed after %d attempts: %s", kind, request.request_id,
                            outcome.attempts, outcome.error)
                episode.status = outcome.status
            elif kind == "reset":
                if isinstance(episode.env, TokenEnvironment):
                    request.prompt_ids = list(outcome.value)  # type: ignore[call-overload]
                episode.is_started = True
                self.engine.add([request])
                continue
            if observation_ids is not None and request.finish_reason is None:
                if has_room_after(request, observation_ids, self.engine.max_len):
                    episode.turn_start = len(request.output_ids) + len(observation_ids)
                    self.engine.resume(request, observation_ids)
                    continue
                self.engine.finish(request, "length")
            if request in self.engine.paused:
                self.engine.finish(request)
            request.finish_reason = request.finish_reason or "stop"  # a reset that failed
            self._end(episode)
            ended.append(request)
        return ended

    def env_result(self, request_id: str) -> EnvResult:
        """What the environment of an ended episode reported, `ok` for a single-turn sample (taken: asked once, by
        whoever emits the sample)."""
        return self.env_results.pop(request_id, EnvResult())

    def _end(self, episode: Episode) -> None:
        del self.episodes[episode.request.request_id]
        if isinstance(episode.env, TokenEnvironment):
            episode.env.close(episode.request)
        ended = "ok" if episode.status == "ok" else "failed"
        self.counts.episodes[ended] += 1
        self.counts.setup_share_sum[ended] += episode.setup_s / max(time.monotonic() - episode.started_at, 1e-9)
        self.env_results[episode.request.request_id] = EnvResult(episode.status, episode.reward)

    async def wait(self, timeout_s: float) -> None:
        """Until an environment call finishes (or `timeout_s`)."""
        try:
            await asyncio.wait_for(self.wakeup.wait(), timeout_s)
        except TimeoutError:
            pass

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _observation(self, episode: Episode, outcome: EnvOutcome) -> tuple[list[int] | None, EnvOutcome]:
        """(observation ids, or None when the episode is done; the outcome, `error` for a malformed step)."""
        step = outcome.value
        if not isinstance(step, EnvStep):
            return None, EnvOutcome("error", None, outcome.attempts, f"step returned {type(step).__name__}")
        if step.reward is not None:
            episode.reward = step.reward
        if step.done:
            return None, outcome
        if step.observation_ids is not None:
            return step.observation_ids, outcome
        try:
            return self.tokenizer.encode(step.observation), outcome
        except Exception as exc:  # text the vocabulary cannot spell is the environment's fault
            return None, EnvOutcome("error", None, outcome.attempts, f"observation {step.observation!r}: {exc}")

    def _spawn(self, episode: Episode, kind: str, call: Callable[[], Awaitable[object]]) -> None:
        async def run() -> None:
            started = time.monotonic()
            outcome = await call_env(call, self.timeout_s, self.max_retries)
            if kind == "reset":
                episode.setup_s = time.monotonic() - started
            self.counts.failed_calls.update(outcome.failures)
            self.ready.append((episode, kind, outcome))
            self.wakeup.set()

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


async def run_episodes(engine: TurnEngine, runner: TurnRunner) -> list[Request]:
    """Drive the engine and the environments until both are idle (evaluation, tests); returns requests as they
    finish. Engine steps run on the event loop, which serves the environments between steps."""
    finished = []
    while engine.has_work or runner.num_pending:
        finished += runner.apply()
        if engine.has_work:
            finished += runner.on_step(engine.step())
            await asyncio.sleep(0)
        elif runner.num_pending and not runner.ready:
            await runner.wait(1.0)
    return finished
