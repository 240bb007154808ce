"""Rollout worker: Group work items in, one Trajectory event per finished sample out, weights hot-swapped.

Multi-turn tasks run their environments beside the engine (shared/engine/turns.py): a sequence waiting on its
environment is paused in its slot while the others decode, and environment results are applied between steps. An
agent task's episodes are sessions of the worker's gateway (shared/agents/gateway.py), on the same event loop: each
is published to the pool's environment workers, whose agents talk to it over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from jetroll.services.rollout.sections import RolloutSections
from jetroll.shared.config.job import JobConfig
from jetroll.shared.engine.factory import build_engine
from jetroll.shared.engine.interface import RolloutEngine, probe
from jetroll.shared.engine.request import EnvResult, Request
from jetroll.shared.engine.turns import TurnRunner
from jetroll.shared.errors import JobFailedError
from jetroll.shared.model.checkpoint import quantization_plan, read_args
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.numerics import QuantizationPlan
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.claims import HeldClaims
from jetroll.shared.protocol.events import (
    Array,
    EpisodeEvent,
    GroupEvent,
    MetricsEvent,
    TrajectoryEvent,
    WeightsPublishedEvent,
)
from jetroll.shared.protocol.in_flight import InFlightIndex
from jetroll.shared.protocol.topology import METRICS, TRAJ_RAW, WEIGHTS, episodes_stream, groups_stream
from jetroll.shared.protocol.validate import EventLimits, check_group, expecting
from jetroll.shared.store.base import WeightStore, WeightStoreError, encode_manifest
from jetroll.shared.tasks.agent import AgentTask
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.env import FlakyEnv, is_multi_turn
from jetroll.shared.tasks.registry import TaskSet

if TYPE_CHECKING:  # the gateway (aiohttp) loads with the first agent group: the `agents` extra
    from jetroll.shared.agents.gateway import Gateway

log = logging.getLogger("jetroll.rollout")


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for p in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(p)).items()}

@dataclass(slots=True)
class InFlightGroup:
    event: GroupEvent
    entry_id: str
    num_pending: int
    started_at: float = field(default_factory=time.time)


class RolloutWorker:
    def __init__(self, job: JobConfig, tasks: TaskSet, bus: RedisBus, store: WeightStore, consumer: str,
                 pool: str | None = None) -> None:
        """The job's values are resolved here, at the worker's entry: the rest reads only `RolloutSections`."""
        self.config = config = RolloutSections.of(job, tasks, pool)
        self.tasks = tasks
        self.bus = bus
        self.store = store
        self.consumer = consumer
        self.pool = config.pool
        self.stream = groups_stream(self.pool.name)
        self.in_flight = InFlightIndex(bus, config.in_flight_slack)
        self.groups: dict[str, InFlightGroup] = {}
        self.pending_weights: tuple[int, dict[str, torch.Tensor]] | None = None
        self.engine_name = config.rollout.engine_of(self.pool)
        self.runs_model = config.rollout.runs_model(self.pool)
        self.plan: QuantizationPlan | None = None  # this worker's, from the model's shape and the job's precision
        self.precision_id = ""  # stamped on trajectories: set with the plan
        self.engine: RolloutEngine | None = None
        self.limits: EventLimits | None = None  # set with the engine: token ids must fit its embedding
        self.tokenizer: Tokenizer | None = None
        self.turns: TurnRunner | None = None  # multi-turn environments (every engine that runs the model)
        self.gateway: Gateway | None = None  # agent tasks' sessions: started with the first agent group
        self.incarnation = secrets.token_hex(4)  # in session ids: a restarted worker never takes old agents' calls
        self.env_failures: Counter[str] = Counter()  # env_status -> trajectories that ended with it
        self.num_tokens = 0
        self.num_trajectories = 0
        self.busy_s = 0.0
        # slot occupancy integrated over wall time, for the rollout idle fraction
        self.busy_slot_s = 0.0
        self.num_occupied = 0
        self.serving_since = self.ticked_at = time.monotonic()

    async def run(self) -> None:
        await self.bus.ensure_group(self.stream.name, self.stream.group)
        version = await self._wait_for_weights()
        directory = await self.store.fetch(version)
        self.plan = quantization_plan(read_args(directory)[0], self.config.precision.numerics())
        self.precision_id = self.config.precision.rollout_precision_id(self.engine_name, self.plan.digest)
        await self._check_plan(version, await asyncio.to_thread(_read_tensors, directory))
        built = build_engine(self.config.rollout, self.config.precision, self.config.seed, self.pool, directory)
        self.engine, self.tokenizer = built.engine, built.tokenizer
        self.limits = replace(self.config.limits, vocab_rows=built.vocab_rows)
        if self.runs_model:  # an engine that draws its samples runs no kernels and no environments
            probe(self.engine, self.engine_name)
            rollout = self.config.rollout
            self.turns = TurnRunner(self.engine, self.tokenizer, rollout.env_timeout_s, rollout.env_max_retries)
        self.engine.version = version
        self.serving_since = self.ticked_at = time.monotonic()
        log.info("%s serving version %d on %s (start-up %.1f s)", self.consumer, version, self.engine_name,
                 self.engine.compile_s)
        try:
            async with asyncio.TaskGroup() as tasks:  # a version the watcher refuses fails the worker too
                tasks.create_task(self._watch_weights())
                tasks.create_task(self._loop())
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            if self.turns is not None:
                await self.turns.close()
            if self.gateway is not None:
                await self.gateway.close()

    async def _wait_for_weights(self) -> int:
        while (version := await self.store.latest()) is None:
            await asyncio.sleep(0.2)
        return version

    async def _watch_weights(self) -> None:
        """Tail the weights stream, polling LATEST as a fallback for a missed event; load a newer version in the
        background, swap at the next token boundary."""
        last_id = "0-0"
        polled_at = time.monotonic()
        while True:
            last_id, events = await self.bus.tail(WEIGHTS, last_id, block_ms=1000)
            # 0 stands for "nothing new": a serving worker is at version 0 or later
            newest = max((e.version for e in events if isinstance(e, WeightsPublishedEvent)), default=0)
            if time.monotonic() - polled_at >= self.config.weights_poll_s:
                polled_at = time.monotonic()
                try:
                    newest = max(newest, await self.store.latest() or 0)
                except WeightStoreError as exc:  # the store is down: keep serving, poll again later
                    log.warning("cannot poll LATEST, serving v%d: %s", self._current_version(), exc)
            if newest > self._current_version():
                await self._load(newest)

    def _current_version(self) -> int:
        assert self.engine is not None
        return self.pending_weights[0] if self.pending_weights else self.engine.version

    async def _load(self, version: int) -> None:
        try:
            directory = await self.store.fetch(version)
            state = await asyncio.to_thread(_read_tensors, directory)
        except (WeightStoreError, OSError, ValueError) as exc:
            log.error("refusing weights v%d, keeping v%d: %s", version, self._current_version(), exc)
            return
        await self._check_plan(version, state)
        self.pending_weights = (version, state)

    async def _check_plan(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse a version whose quantization plan, or whose tensors, differ from this worker's plan: dead-letter it
        with the first difference, and fail the job. Both plans come from the job's config, so no later version can
        heal a difference, and serving on would run another precision than the job names. An engine that runs no
        model has nothing to check."""
        if not self.runs_model:
            return
        assert self.plan is not None
        manifest = await self.store.manifest(version)
        if manifest.quantization_plan is None:
            problem = "its manifest carries no quantization plan"
        else:
            problem = self.plan.first_difference(manifest.quantization_plan, f"{self.consumer}'s plan",
                                                 f"version {version}'s") or self.plan.check_tensors(tensors)
        if problem is None:
            return
        reason = f"{self.consumer} ({self.engine_name}) refuses weights v{version}: {problem}"
        await self.bus.dead_letter(WEIGHTS, f"v{version}", encode_manifest(manifest), reason)
        raise JobFailedError(reason)

    async def _loop(self) -> None:
        assert self.engine is not None
        engine, limits = self.engine, self.limits
        assert limits is not None
        is_group = expecting(GroupEvent, lambda group: check_group(group, limits))
        claims = HeldClaims(self.bus, self.stream.name, self.stream.group, self.consumer,
                            self.config.redis.claim_idle_ms)
        while True:
            await claims.keep(g.entry_id for g in self.groups.values())
            await self._swap_pending()
            if self.turns is not None and (ended := self.turns.apply()):  # environment results, at a token boundary
                await self._emit(ended)
            num_env_pending = self.turns.num_pending if self.turns is not None else 0
            num_free = engine.num_free_slots - (self.turns.num_resetting if self.turns is not None else 0)
            if num_free > 0:  # a free slot pulls a whole group; its other samples wait in the engine
                num_groups = math.ceil(num_free / self.config.group_size)
                deliveries = await self.bus.consume(self.stream.name, self.stream.group, self.consumer,
                                                    count=num_groups,
                                                    block_ms=0 if engine.has_work or num_env_pending else 200,
                                                    check=is_group)
                started = []
                for delivery in deliveries:
                    assert isinstance(delivery.event, GroupEvent)  # `is_group` dead-lettered anything else
                    await self._start(delivery.event, delivery.entry_id)
                    started.append(delivery.event)
                # a group's oldest token is at least this version: the trainer's eta_hard wait goes by it
                await self.in_flight.started(started, engine.version)
            if not engine.has_work:
                if num_env_pending:
                    assert self.turns is not None
                    await self.turns.wait(0.2)
                continue
            self._tick()
            started = time.perf_counter()
            finished = await asyncio.to_thread(engine.step)
            self.busy_s += time.perf_counter() - started
            self._tick()
            if self.turns is not None:
                finished = self.turns.on_step(finished)  # ended turns go to their environments
            if finished:
                await self._emit(finished)

    def _tick(self) -> None:
        """Integrate slot occupancy: the slots held since the last tick, then those held from now on."""
        assert self.engine is not None
        now = time.monotonic()
        self.busy_slot_s += (now - self.ticked_at) * self.num_occupied
        self.ticked_at = now
        engine = self.engine
        self.num_occupied = min(len(engine.running) + len(engine.paused) + len(engine.waiting), engine.max_batch)

    async def _swap_pending(self) -> None:
        """Swap in weights loaded in the background; called only at a token boundary."""
        assert self.engine is not None
        if self.pending_weights is None:
            return
        version, state = self.pending_weights
        self.pending_weights = None
        self.engine.swap_weights(state, version, recompute_kv=self.config.rollout.recompute_kv_on_swap)
        await self._metrics({"weight_version": version})

    async def _start(self, group: GroupEvent, entry_id: str) -> None:
        assert self.engine is not None
        if group.group_id in self.groups:  # our own entry, reclaimed while still in flight
            return
        # compare with the weights in use, not a pending load: its swap would come after this group's first token
        if group.min_version > self.engine.version:
            if self._current_version() < group.min_version:
                await self._load(await self.store.latest() or group.min_version)
            await self._swap_pending()
        prompt_ids = group.prompt_ids.numpy().tolist()
        max_new = min(group.max_new_tokens, self.engine.max_len - len(prompt_ids))
        self.groups[group.group_id] = InFlightGroup(group, entry_id, group.group_size)
        task = self.tasks[group.task]
        if isinstance(task, AgentTask):
            await self._start_sessions(group, task, prompt_ids, max_new)
            return
        is_episode = self.turns is not None and is_multi_turn(task)
        turn_end_id = self.tokenizer.encode(task.turn_end)[0] if is_episode and self.tokenizer else None
        requests = [Request(f"{group.group_id}:{i}", prompt_ids, max_new, self.config.rollout.temperature,
                            self.config.rollout.top_p, turn_end_id=turn_end_id) for i in range(group.group_size)]
        if not is_episode:
            self.engine.add(requests)
            return
        assert self.turns is not None
        faults = self.config.env_faults.get(group.task)
        for request in requests:  # each joins the engine once its environment has reset
            env = task.make_env()
            if faults is not None:
                env = FlakyEnv(env, faults.delay_s, faults.failure_rate,
                               random.Random(f"{self.config.seed}:{request.request_id}"))
            self.turns.start(request, env, Problem(group.prompt, group.answer))

    async def _start_sessions(self, group: GroupEvent, task: AgentTask, prompt_ids: list[int], max_new: int) -> None:
        """An agent group: one gateway session per sample, each published to the pool's environment workers; a
        sample's request joins the engine with its agent's first request (the group's prompt ids stand in until
        then)."""
        if self.turns is None or self.tokenizer is None:
            raise JobFailedError(f"task {group.task} is an agent task: rollout.engine {self.engine_name} runs no "
                                 "environments")
        if self.gateway is None:
            from jetroll.shared.agents.gateway import Gateway

            rollout = self.config.rollout
            self.gateway = Gateway(self.tokenizer, rollout.max_seq_len, rollout.temperature, rollout.top_p,
                                   host=rollout.gateway_host)
            await self.gateway.start()
            episodes = episodes_stream(self.pool.name)
            await self.bus.ensure_group(episodes.name, episodes.group)
            log.info("%s: agents' gateway at %s", self.consumer, self.gateway.url)
        episodes = []
        for i in range(group.group_size):
            request = Request(f"{group.group_id}:{i}", prompt_ids, max_new, self.config.rollout.temperature,
                              self.config.rollout.top_p, turn_end_id=self.tokenizer.eos_id)
            session = self.gateway.open(f"{request.request_id}~{self.incarnation}", max_new, task.timeout_s)
            self.turns.start(request, session, Problem(group.prompt, group.answer))
            episodes.append(EpisodeEvent(job_id=self.config.job_id, session_id=session.session_id, url=session.url,
                                         task=group.task, pool=self.pool.name, prompt=group.prompt,
                                         answer=group.answer))
        # the sessions' agents, launched: their episodes go to the pool's environment workers
        await self.bus.publish_many(episodes_stream(self.pool.name).name, episodes)

    async def _emit(self, finished: list[Request]) -> None:
        await self.bus.wait_for_capacity(TRAJ_RAW.name, TRAJ_RAW.group, self.config.redis.max_lag)
        events, done_groups = [], []
        for request in finished:
            group_id, sample = request.request_id.rsplit(":", 1)
            flight = self.groups[group_id]
            env = self._env_result(request.request_id)
            events.append(self._trajectory(flight.event, int(sample), request, env))
            self.num_tokens += len(request.output_ids)
            if env.status != "ok":
                self.env_failures[env.status] += 1
            flight.num_pending -= 1
            if flight.num_pending == 0:
                done_groups.append(self.groups.pop(group_id))
        await self.bus.publish_many(TRAJ_RAW.name, events)
        if done_groups:  # ack a Group only after all its samples are emitted
            await self.bus.ack(self.stream.name, self.stream.group, *(g.entry_id for g in done_groups))
            self._tick()
            self.num_trajectories += len(events)
            await self._metrics({"tokens_per_s": self.num_tokens / max(self.busy_s, 1e-9),
                                 "num_tokens": self.num_tokens, "num_trajectories": self.num_trajectories,
                                 "busy_slot_s": self.busy_slot_s,
                                 **{f"env_fail/{status}": n for status, n in self.env_failures.items()},
                                 **self._env_counts(),
                                 "slot_s": (time.monotonic() - self.serving_since) * self.engine.max_batch})

    def _env_counts(self) -> dict[str, float]:
        """The environments' failed calls by status (retried ones included), their ended episodes and the sum of
        those episodes' set-up shares, by how each ended (cumulative; the controller totals them per pool)."""
        if self.turns is None:
            return {}
        counts = self.turns.counts
        return {**{f"env_failed_calls/{status}": n for status, n in counts.failed_calls.items()},
                **{f"env_episodes/{ended}": n for ended, n in counts.episodes.items()},
                **{f"env_setup_share_sum/{ended}": total for ended, total in counts.setup_share_sum.items()}}

    def _env_result(self, request_id: str) -> EnvResult:
        """What the sample's environment reported: through the turn runner, or what the engine drew."""
        assert self.engine is not None
        return self.turns.env_result(request_id) if self.turns is not None else self.engine.env_result(request_id)

    def _trajectory(self, group: GroupEvent, sample: int, request: Request, env: EnvResult) -> TrajectoryEvent:
        return TrajectoryEvent(
            job_id=group.job_id, traj_id=request.request_id, group_id=group.group_id, sample=sample,
            task=group.task, pool=group.pool, prompt=group.prompt, answer=group.answer,
            prompt_ids=Array.of(request.prompt_ids, "<i4"),  # an agent's: its first request's, rendered
            completion_ids=Array.of(request.output_ids, "<i4"),
            loss_mask=Array.of(request.loss_mask, "<u1"),
            behavior_logprobs=Array.of(request.logprobs, "<f4"),
            v_tok=Array.of(request.versions, "<i4"),
            v_adm=group.v_adm, group_size=group.group_size,
            temperature=request.temperature, top_p=request.top_p,
            precision_id=self.precision_id,
            finish_reason="stop" if request.finish_reason == "stop" else "length",
            env_status=env.status,
            env_reward=env.reward,
            worker=self.consumer,
            timings={"finished_at": time.time()},
        )

    async def _metrics(self, values: dict[str, float]) -> None:
        assert self.engine is not None
        await self.bus.publish(METRICS, MetricsEvent(
            # pool/<name>/ lets the controller total each pool over its workers
            job_id=self.config.job_id, service=self.consumer,
            values={f"pool/{self.pool.name}/{name}": float(value) for name, value in values.items()},
            step=self.engine.version))

