"""Celery runner: the task `jetroll.reward` runs any registered reward by name, JSON in and JSON out.

Run a worker with `celery -A jetroll.functions.celery_app worker --pool=prefork -Q jetroll.reward`. It reads
JETROLL_CELERY_BROKER_URL, JETROLL_CELERY_QUEUE, JETROLL_CELERY_SOFT_TIME_LIMIT_S, JETROLL_CELERY_HARD_TIME_LIMIT_S,
JETROLL_CELERY_VISIBILITY_TIMEOUT_S and JETROLL_REWARD_MODULES; the router sends its own time limits with each call.

Exactly once per call: a request carries a result `key`. The first outcome is kept with SET NX and pushed to
`{key}:reply`, where the router waits. A redelivered task (acks_late: its worker died mid-task) finds the kept
outcome and returns it instead of scoring again; a call whose worker dies on every run ends as an error after
MAX_RUNS runs instead of being redelivered forever.

A worker exits (code 1) when it loses its broker after it connected: run it under a supervisor that restarts it (the
launcher, `restart:` in compose). At start it waits for the broker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

from billiard.process import active_children
from celery import Celery, Task
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.worker.consumer import Consumer

from jetroll.functions.runner import call_reward, import_reward_modules
from jetroll.shared.protocol.call_records import CeleryRecords

TASK_NAME = "jetroll.reward"
DEFAULT_QUEUE = "jetroll.reward"
MAX_RUNS = 3
log = logging.getLogger("jetroll.celery")


class ExitOnBrokerLoss(Consumer):
    """A worker that loses its broker after it connected kills its pool and exits (code 1); its supervisor restarts it
    clean. Nothing is lost: its tasks are unacked (acks_late), and the router sends its calls again.

    Celery's own ways out all hang here: its reconnect blocks the loop that reads the pool's results, so when it
    returns the time limits kill children whose tasks had finished (one cut mid-write wedges the pool), and both its
    warm and its cold stop can deadlock against a child blocked writing a result to the pool's pipe."""

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        log.critical("lost the broker (%r): killing the pool and exiting, to be restarted clean", exc)
        for child in active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
        logging.shutdown()
        os._exit(1)


def make_app(
    broker_url: str,
    *,
    soft_time_limit_s: float,
    hard_time_limit_s: float,
    visibility_timeout_s: float,
    queue: str = DEFAULT_QUEUE,
) -> Celery:
    """A Celery app on a Redis broker with jetroll's delivery settings (the worker's and the router's)."""
    if not 0 < soft_time_limit_s < hard_time_limit_s < visibility_timeout_s:
        raise ValueError(
            "celery limits need 0 < soft_time_limit_s < hard_time_limit_s < visibility_timeout_s, got "
            f"{soft_time_limit_s} / {hard_time_limit_s} / {visibility_timeout_s}"
        )
    app = Celery("jetroll", broker=broker_url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_consumer=f"{__name__}:ExitOnBrokerLoss",
        # A message unacked this long is handed to another worker: above the hard limit, so a live task never is.
        broker_transport_options={
            "visibility_timeout": visibility_timeout_s,
            "unacked_restore_interval": max(1.0, min(10.0, visibility_timeout_s / 10)),
            "unacked_restore_throttle": 1,
        },
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,  # outcomes travel through the result key, not a result backend
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_soft_time_limit=soft_time_limit_s,
        task_time_limit=hard_time_limit_s,
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        worker_pool="prefork",
        # billiard waits this long for a dead pool child's result before requeueing its task (default 10 s);
        # outcomes never travel through the pool, so waiting longer only delays the redelivery
        worker_lost_wait=1.0,
    )
    return app


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


_soft_s = _env_float("JETROLL_CELERY_SOFT_TIME_LIMIT_S", 10.0)
app = make_app(
    os.environ.get("JETROLL_CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"),
    soft_time_limit_s=_soft_s,
    hard_time_limit_s=_env_float("JETROLL_CELERY_HARD_TIME_LIMIT_S", _soft_s + 5.0),
    visibility_timeout_s=_env_float("JETROLL_CELERY_VISIBILITY_TIMEOUT_S", 300.0),
    queue=os.environ.get("JETROLL_CELERY_QUEUE", DEFAULT_QUEUE),
)
import_reward_modules()  # before the pool forks, so every child knows the user's rewards

records = CeleryRecords(app.conf.broker_url)


class RewardTask(Task):
    """Reports a hard time limit as a `timeout` outcome: the pool child was killed, so the task body cannot."""

    def on_failure(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        if isinstance(exc, TimeLimitExceeded) and args and isinstance(args[0], dict):
            request = args[0]
            records.keep_first(request["key"], {"status": "timeout", "detail": f"hard time limit exceeded ({exc})"},
                               int(request["ttl_s"]))


@app.task(name=TASK_NAME, base=RewardTask, bind=True)
def score_reward(self: Task, request: dict[str, Any]) -> dict[str, Any]:
    """Score one call: {"reward", "completion", "answer", "key", "ttl_s"} -> {"status", "reward", "correct", ...}."""
    kept = records.kept(request["key"])
    if kept is not None:
        return kept
    if records.count_run(request["key"], int(request["ttl_s"])) > MAX_RUNS:
        outcome = {"status": "error", "detail": f"the worker died in each of {MAX_RUNS} runs of this reward call"}
    else:
        try:
            outcome = {"status": "ok", **call_reward(request)}
        except SoftTimeLimitExceeded:
            outcome = {"status": "timeout", "detail": "soft time limit exceeded"}
        except Exception as exc:  # a failing reward is a status, never a reward
            outcome = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"}
    return records.keep_first(request["key"], outcome, int(request["ttl_s"]))
