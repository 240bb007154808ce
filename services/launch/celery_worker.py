"""A local `celery -A jetroll.functions.celery_app worker --pool=prefork` process, configured from the reward config.

The launcher starts one for a job whose tasks use celery; the bench and the tests use `CeleryWorker`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from jetroll.functions.celery_app import make_app
from jetroll.services.launch.procs import stop_processes
from jetroll.shared.config.reward import RewardConfig


def worker_env(config: RewardConfig, broker_url: str) -> dict[str, str]:
    """The environment `jetroll.functions.celery_app` reads (besides the inherited one)."""
    return {
        "JETROLL_CELERY_BROKER_URL": broker_url,
        "JETROLL_CELERY_QUEUE": config.celery_queue,
        "JETROLL_CELERY_SOFT_TIME_LIMIT_S": str(config.timeout_s),
        "JETROLL_CELERY_HARD_TIME_LIMIT_S": str(config.celery_hard_time_limit_s),
        "JETROLL_CELERY_VISIBILITY_TIMEOUT_S": str(config.celery_visibility_timeout_s),
        "JETROLL_REWARD_MODULES": ",".join(config.modules),
    }


def worker_command(config: RewardConfig, node: str) -> list[str]:
    # gossip, mingle and heartbeats only chat between workers; remote control (ping) stays on
    return [sys.executable, "-m", "celery", "-A", "jetroll.functions.celery_app", "worker", "--pool=prefork",
            f"--concurrency={config.celery_concurrency}", "-Q", config.celery_queue, "-n", node, "--loglevel=INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]


def start_worker_process(config: RewardConfig, broker_url: str, node: str, log: IO[bytes] | int,
                         env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """The worker in a process group of its own, so that a kill reaches its pool children too; `env` adds to the
    inherited environment."""
    return subprocess.Popen(worker_command(config, node), env={**os.environ, **(env or {}), **worker_env(config,
                            broker_url)}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


class CeleryWorker:
    """One worker in its own process group, so that a kill reaches its pool children too."""

    def __init__(self, config: RewardConfig, broker_url: str, log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.config = config
        self.broker_url = broker_url
        self.log_path = log_path
        self.env = env
        self.node = f"jetroll-{uuid.uuid4().hex[:8]}@localhost"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "worker not started"
        return self.process.pid

    def start(self, ready_timeout_s: float = 60.0) -> CeleryWorker:
        """Start and wait until the worker answers a ping; RuntimeError (with its log) if it does not."""
        self._log = self.log_path.open("ab") if self.log_path else None
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.process = start_worker_process(self.config, self.broker_url, self.node, out, self.env)
        app = make_app(self.broker_url, soft_time_limit_s=self.config.timeout_s,
                       hard_time_limit_s=self.config.celery_hard_time_limit_s,
                       visibility_timeout_s=self.config.celery_visibility_timeout_s)
        deadline = time.monotonic() + ready_timeout_s
        try:
            while not app.control.ping(destination=[self.node], timeout=0.5):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = self.log_path.read_text(errors="replace")[-3000:] if self.log_path else ""
                    self.stop()
                    raise RuntimeError(f"celery worker {self.node} did not become ready: {log}")
        finally:
            app.close()
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (main process and pool children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Warm shutdown (SIGTERM to the main process), then SIGKILL whatever of the group is left."""
        if self.process is None:
            return
        stop_processes([self.process], timeout_s, groups=True)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> CeleryWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
