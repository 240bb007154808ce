"""The reward router: traj:raw -> score with the task's reward (retry once) -> traj:scored, then ack."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from services.reward.pool import RewardPool
from shared.bus import Delivery, RedisBus
from shared.events import MetricsEvent, RewardStatus, ScoredEvent, TrajectoryEvent, encode
from shared.tasks import get_task

log = logging.getLogger(__name__)

RAW_STREAM = "traj:raw"
SCORED_STREAM = "traj:scored"
METRICS_STREAM = "metrics"
GROUP = "reward"
SEEN_KEY = "seen:reward"  # hash traj_id -> entry_id of the first entry that carried it


class RewardRouter:
    """Consumes trajectories, scores them in a RewardPool and publishes one ScoredEvent per traj_id.

    Delivery is at least once: an entry is acked only after its ScoredEvent is written, so a crash
    between the two re-scores it (the trainer keeps the first event per traj_id). Keep the bus's
    `claim_idle_ms` above `(1 + max_retries) * timeout_s`, or slow entries are reclaimed while in flight.
    """

    def __init__(
        self,
        bus: RedisBus,
        pool: RewardPool,
        detokenize: Callable[[np.ndarray], str],
        *,
        consumer: str,
        max_retries: int = 1,
        backend: str = "local",
        block_ms: int = 1000,
        metrics_every_s: float = 5.0,
    ) -> None:
        self.bus = bus
        self.pool = pool
        self.detokenize = detokenize
        self.consumer = consumer
        self.max_retries = max_retries
        self.backend = backend
        self.block_ms = block_ms
        self.metrics_every_s = metrics_every_s
        self.max_in_flight = pool.num_workers
        self.counts = {"scored": 0, "ok": 0, "timeout_attempts": 0, "error_attempts": 0, "duplicates": 0}
        self._in_flight_ids: set[str] = set()
        self._metrics_at = time.monotonic()
        self._metrics_scored = 0

    async def run(self) -> None:
        """Score trajectories until cancelled; an exception (e.g. Redis gone) propagates, leaving entries unacked."""
        await self.bus.ensure_group(RAW_STREAM, GROUP)
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while True:
                free = self.max_in_flight - len(in_flight)
                if free > 0:
                    block_ms = 50 if in_flight else self.block_ms
                    for delivery in await self.bus.consume(
                        RAW_STREAM, GROUP, self.consumer, count=free, block_ms=block_ms
                    ):
                        if delivery.entry_id in self._in_flight_ids:
                            continue  # reclaimed while we still work on it; that task acks it
                        self._in_flight_ids.add(delivery.entry_id)
                        in_flight.add(asyncio.create_task(self.handle(delivery)))
                if len(in_flight) >= self.max_in_flight:
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                done = {task for task in in_flight if task.done()}
                in_flight -= done
                for task in done:
                    task.result()
                await self._maybe_emit_metrics()
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def handle(self, delivery: Delivery) -> None:
        """Dedupe, score, publish, then ack one raw entry."""
        try:
            event = delivery.event
            if not isinstance(event, TrajectoryEvent):
                reason = f"expected a traj event on {RAW_STREAM}, got {type(event).__name__}"
                await self.bus.dead_letter(RAW_STREAM, delivery.entry_id, encode(event), reason)
            elif await self._claim(event.traj_id, delivery.entry_id):
                scored = await self.score(event)
                await self.bus.publish(SCORED_STREAM, scored)
            else:
                self.counts["duplicates"] += 1
            await self.bus.ack(RAW_STREAM, GROUP, delivery.entry_id)
        finally:
            self._in_flight_ids.discard(delivery.entry_id)

    async def _claim(self, traj_id: str, entry_id: str) -> bool:
        """True for the first entry carrying traj_id (and for redeliveries of that same entry)."""
        key = self.bus.key(SEEN_KEY)
        if await self.bus.redis.hsetnx(key, traj_id, entry_id):
            return True
        owner = await self.bus.redis.hget(key, traj_id)
        return owner is not None and owner.decode() == entry_id

    async def score(self, traj: TrajectoryEvent) -> ScoredEvent:
        """Score one trajectory: retry a timeout or error `max_retries` times; what is still not ok is final."""
        t0 = time.monotonic()
        attempts = 0
        status: RewardStatus = "error"
        reward: float | None = None
        details: dict[str, Any]
        try:
            reward_name = get_task(traj.task).reward
            completion = self.detokenize(traj.completion_ids.numpy())
        except Exception as exc:  # bad input is a final error status, never a lost trajectory
            details = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            while True:
                attempts += 1
                status, out, detail = await self.pool.score(reward_name, completion, traj.answer)
                if status == "ok":
                    assert out is not None
                    reward, details = out.reward, {"correct": out.correct}
                    break
                self.counts[f"{status}_attempts"] += 1
                details = {"error": detail}
                if attempts > self.max_retries:
                    log.warning("reward %s for %s final after %d attempts: %s", status, traj.traj_id, attempts, detail)
                    break
        self.counts["scored"] += 1
        self.counts["ok"] += status == "ok"
        return ScoredEvent(
            job_id=traj.job_id,
            trajectory=traj,
            reward=reward,
            status=status,
            attempts=attempts,
            backend=self.backend,
            latency_s=time.monotonic() - t0,
            details=details,
        )

    async def _maybe_emit_metrics(self) -> None:
        now = time.monotonic()
        elapsed = now - self._metrics_at
        if elapsed < self.metrics_every_s or self.counts["scored"] == self._metrics_scored:
            return
        step = self.counts["scored"]
        values = {
            "reward/throughput_per_s": (step - self._metrics_scored) / elapsed,
            "reward/scored": step,
            "reward/timeouts": self.counts["timeout_attempts"],
            "reward/errors": self.counts["error_attempts"],
            "reward/duplicates": self.counts["duplicates"],
        }
        events = [
            MetricsEvent(job_id=self.bus.job_id, service="reward", name=name, value=float(value), step=step)
            for name, value in values.items()
        ]
        await self.bus.publish_many(METRICS_STREAM, events)
        self._metrics_at, self._metrics_scored = now, step
