"""Supervising, stopping and restarting services, written once for every launcher (local, Ray, watch mode)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from jetroll.shared.errors import JOB_FAILED_EXIT

STOP_TIMEOUT_S = 10.0


def stop_processes(processes: Iterable[subprocess.Popen], timeout_s: float = STOP_TIMEOUT_S, *,
                   groups: bool = False) -> None:
    """SIGTERM every live process, give them `timeout_s` in all, then SIGKILL what is left. With `groups`, each
    process's whole group gets SIGKILL at the end, exited or not: a Celery worker's pool children outlive it."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


async def stop_process(process: asyncio.subprocess.Process, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """The same for a process of the event loop; True when it ignored SIGTERM and was killed."""
    if process.returncode is not None:
        return False
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
        return False
    except TimeoutError:
        process.kill()
        await process.wait()
        return True


@dataclass(slots=True)
class Lives:
    """A service's restart budget, `launch.max_restarts`. Each life consumes under its own name, so the next one
    reclaims the dead one's unacked entries (XAUTOCLAIM)."""

    name: str
    max_restarts: int
    num_restarts: int = 0

    @property
    def consumer(self) -> str:
        return self.name if not self.num_restarts else f"{self.name}-r{self.num_restarts}"

    def died(self) -> bool:
        """Count a death; True when a restart is left (and taken), False when the service is dead for good."""
        if self.num_restarts >= self.max_restarts:
            return False
        self.num_restarts += 1
        return True


async def supervise(lives: Lives, run_life: Callable[[str], Awaitable[int | None]],
                    on_death: Callable[[str, int, bool], None], *, may_finish: bool = True) -> int | None:
    """The one restart loop: run lives of a service, each under its own consumer name, until one ends cleanly (0, or
    None: its job ended first) or a death finds no restart left; returns that life's code. `on_death(consumer, code,
    is_restarted)` reports each death. A service that serves until stopped (`may_finish` False) dies by exiting,
    even with 0. A life that exits with JOB_FAILED_EXIT failed the job: it is not restarted."""
    while True:
        consumer = lives.consumer
        code = await run_life(consumer)
        if code is None or (code == 0 and may_finish):
            return code
        is_restarted = code != JOB_FAILED_EXIT and lives.died()
        on_death(consumer, code, is_restarted)
        if not is_restarted:
            return code
