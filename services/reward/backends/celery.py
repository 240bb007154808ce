"""Celery backend: send `jetroll.reward` to the queue, then wait on the call's reply list in the broker Redis.

Each attempt has its own result key, `{prefix}:{traj_id}:{attempt}`. The worker keeps the first outcome under it
(SET NX), so a task redelivered after its worker died yields the same single outcome, and a restarted router that
finds the key reads it instead of sending the task again.
"""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from jetroll.functions.celery_app import TASK_NAME, make_app
from jetroll.services.reward.backends.base import RECORD_TTL_S, Outcome, RewardBackend, RewardCall

WAIT_MARGIN_S = 5.0


class CeleryBackend(RewardBackend):
    """Reward calls as Celery tasks on a Redis broker (acks_late, reject_on_worker_lost, soft and hard limits)."""

    name = "celery"

    def __init__(
        self,
        broker_url: str,
        *,
        key_prefix: str,
        queue: str,
        concurrency: int,
        soft_time_limit_s: float,
        hard_time_limit_s: float,
        visibility_timeout_s: float,
    ) -> None:
        super().__init__(concurrency)
        self.app = make_app(broker_url, soft_time_limit_s=soft_time_limit_s, hard_time_limit_s=hard_time_limit_s,
                            visibility_timeout_s=visibility_timeout_s, queue=queue)
        self.key_prefix = key_prefix
        self.queue = queue
        self.soft_time_limit_s = soft_time_limit_s
        self.hard_time_limit_s = hard_time_limit_s
        # A task whose whole worker died runs again only after the visibility timeout, then up to the hard limit.
        self.wait_s = visibility_timeout_s + hard_time_limit_s + WAIT_MARGIN_S
        self.ttl_s = int(max(RECORD_TTL_S, 2 * self.wait_s))
        # redis-py's default 5 s socket timeout would cut BLPOP short and could drop a reply it already popped
        self.redis: aioredis.Redis = aioredis.Redis.from_url(broker_url, protocol=2,
                                                             socket_timeout=self.wait_s + WAIT_MARGIN_S)

    async def _score(self, call: RewardCall) -> Outcome:
        key = f"{self.key_prefix}:{call.traj_id}:{call.attempt}"
        kept = await self.redis.get(key)
        if kept is None:
            request = {**call.request(), "key": key, "ttl_s": self.ttl_s}
            # send_task blocks on a socket: keep it off the event loop
            await asyncio.to_thread(self.app.send_task, TASK_NAME, args=[request], queue=self.queue,
                                    soft_time_limit=self.soft_time_limit_s, time_limit=self.hard_time_limit_s)
            reply = await self.redis.blpop([f"{key}:reply"], timeout=self.wait_s)
            if reply is None:
                return Outcome("timeout", detail=f"no outcome from a Celery worker within {self.wait_s:.0f}s")
            kept = reply[1]
            await self.redis.delete(f"{key}:reply")
        return Outcome.from_reply(json.loads(kept))

    async def close(self) -> None:
        await self.redis.aclose()
        self.app.close()
