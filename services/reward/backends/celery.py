"""Celery backend: send `jetroll.reward` to the queue, then wait on the call's reply list in the broker Redis.

Each attempt has its own result key, `{prefix}:{traj_id}:{attempt}`. The worker keeps the first outcome under it
(SET NX), so a task redelivered after its worker died yields the same single outcome, and a restarted router that
finds the key reads it instead of sending the task again. A call that loses the broker waits for it and sends its
task again (an outcome the worker could not write is lost with the outage); the copies keep one outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time

import kombu.exceptions

from jetroll.functions.celery_app import TASK_NAME, make_app
from jetroll.services.reward.backends.base import RECORD_TTL_S, Outcome, RewardBackend, RewardCall
from jetroll.shared.protocol.call_records import BrokerUnreachable, CeleryReplies

WAIT_MARGIN_S = 5.0
BROKER_RETRY_S = 1.0
log = logging.getLogger("jetroll.reward")


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
        self.queue = queue
        self.soft_time_limit_s = soft_time_limit_s
        self.hard_time_limit_s = hard_time_limit_s
        # A task whose whole worker died runs again only after the visibility timeout, then up to the hard limit.
        self.wait_s = visibility_timeout_s + hard_time_limit_s + WAIT_MARGIN_S
        self.ttl_s = int(max(RECORD_TTL_S, 2 * self.wait_s))
        self.replies = CeleryReplies(broker_url, key_prefix, self.wait_s)

    async def _score(self, call: RewardCall) -> Outcome:
        """The call's outcome; while the broker is unreachable, wait for it (up to `wait_s`), then send again."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return await self._send_and_wait(call)
            except (BrokerUnreachable, kombu.exceptions.OperationalError) as exc:
                if time.monotonic() > deadline:
                    return Outcome("error", detail=f"Celery broker unreachable for {self.wait_s:.0f}s: {exc}")
                log.warning("Celery broker unreachable for %s, retrying in %.0f s: %s", call.traj_id, BROKER_RETRY_S,
                            exc)
                await asyncio.sleep(BROKER_RETRY_S)

    async def _send_and_wait(self, call: RewardCall) -> Outcome:
        key = self.replies.key(call.traj_id, call.attempt)
        kept = await self.replies.kept(key)
        if kept is None:
            request = {**call.request(), "key": key, "ttl_s": self.ttl_s}
            # send_task blocks on a socket: keep it off the event loop
            await asyncio.to_thread(self.app.send_task, TASK_NAME, args=[request], queue=self.queue,
                                    soft_time_limit=self.soft_time_limit_s, time_limit=self.hard_time_limit_s)
            kept = await self.replies.wait(key)
            if kept is None:
                return Outcome("timeout", detail=f"no outcome from a Celery worker within {self.wait_s:.0f}s")
        return Outcome.from_reply(kept)

    async def close(self) -> None:
        await self.replies.close()
        self.app.close()
