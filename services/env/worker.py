"""Environment worker: a pool's agent episodes in, each agent run against its gateway session, the outcome out to
the session (which ends the episode; the rollout worker emits its trajectory).

One process runs many episodes at once on asyncio: an agent mostly waits on the policy, so while some wait, others
set up or call their tools. An entry is acked once its session has the outcome, or once the session cannot take it
(gone with its rollout worker, whose group is rolled again). A killed worker's entries are reclaimed by a live one
after `redis.claim_idle_ms`; an agent started again on a session that has turns already is refused by the gateway
(its history does not extend the session's), so that episode ends `error`, its group dropped and counted. A hung
worker is its sessions' deadline: they end `timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from jetroll.shared.agents.client import end_session, run_agent
from jetroll.shared.config.job import JobConfig
from jetroll.shared.protocol.bus import Delivery, RedisBus
from jetroll.shared.protocol.claims import HeldClaims
from jetroll.shared.protocol.events import EpisodeEvent, MetricsEvent
from jetroll.shared.protocol.topology import METRICS, episodes_stream
from jetroll.shared.protocol.validate import EventLimits, check_episode, expecting
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.registry import TaskSet

log = logging.getLogger("jetroll.env")
READ_BATCH = 16
METRICS_EVERY_S = 5.0


class EnvWorker:
    def __init__(self, config: JobConfig, tasks: TaskSet, bus: RedisBus, consumer: str,
                 pool: str | None = None) -> None:
        # what the worker needs of the job, resolved here at its entry: its pool, the limits on episodes, its claims
        self.job_id = config.job_id
        self.claim_idle_ms = config.redis.claim_idle_ms
        self.limits = EventLimits.of(config, tasks, 1)  # an episode carries no token ids
        self.tasks = tasks
        self.bus = bus
        self.consumer = consumer
        self.pool = config.rollout.pool(pool) if pool else config.rollout.pools[0]
        self.stream = episodes_stream(self.pool.name)
        self.running: dict[str, asyncio.Task[None]] = {}  # entry id -> its episode
        self.outcomes: Counter[str] = Counter()  # episodes by status; `unreported`: the session was gone
        self.metrics_at = time.monotonic()

    async def run(self) -> None:
        await self.bus.ensure_group(self.stream.name, self.stream.group)
        is_episode = expecting(EpisodeEvent, lambda episode: check_episode(episode, self.limits))
        claims = HeldClaims(self.bus, self.stream.name, self.stream.group, self.consumer, self.claim_idle_ms)
        log.info("%s running pool %s's agents", self.consumer, self.pool.name)
        try:
            while True:
                await claims.keep(self.running)
                deliveries = await self.bus.consume(self.stream.name, self.stream.group, self.consumer,
                                                    count=READ_BATCH, block_ms=500, check=is_episode)
                for delivery in deliveries:
                    if delivery.entry_id not in self.running:  # our own entry, reclaimed while it runs
                        task = asyncio.create_task(self._episode(delivery))
                        self.running[delivery.entry_id] = task
                await self._maybe_report()
        finally:
            for task in self.running.values():
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def _episode(self, delivery: Delivery) -> None:
        event = delivery.event
        assert isinstance(event, EpisodeEvent)  # `is_episode` dead-lettered anything else
        task = self.tasks[event.task]
        timeout_s = task.timeout_s  # type: ignore[attr-defined]
        try:
            outcome = await run_agent(task.agent, Problem(event.prompt, event.answer), event.url,  # type: ignore[attr-defined]
                                      timeout_s)
            if outcome.status != "ok":
                log.warning("agent of %s ended %s: %s", event.session_id, outcome.status, outcome.reason)
            taken = await end_session(event.url, outcome)
            self.outcomes[outcome.status if taken else "unreported"] += 1
            await self.bus.ack(self.stream.name, self.stream.group, delivery.entry_id)
        finally:
            del self.running[delivery.entry_id]

    async def _maybe_report(self) -> None:
        if time.monotonic() - self.metrics_at < METRICS_EVERY_S:
            return
        self.metrics_at = time.monotonic()
        values = {f"pool/{self.pool.name}/agent_episodes/{status}": float(n) for status, n in self.outcomes.items()}
        values[f"pool/{self.pool.name}/agent_episodes_running"] = float(len(self.running))
        await self.bus.publish(METRICS, MetricsEvent(job_id=self.job_id, service=self.consumer, values=values,
                                                     step=0))
