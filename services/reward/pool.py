"""A local reward process pool whose per-call timeout kills and replaces the worker that overran.

concurrent.futures cannot abandon a running call, so each worker is a `spawn` process with its own Pipe.
Requests and replies are plain dicts of strings and numbers; reward functions are called by registry name.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from jetroll.functions.registry import RewardOutput
from jetroll.functions.runner import call_reward, import_reward_modules

PoolStatus = Literal["ok", "timeout", "error"]

_CTX = mp.get_context("spawn")


def _worker_main(conn: Connection, modules: Sequence[str]) -> None:
    """Worker loop: import the extra reward modules, then answer requests until None/EOF."""
    import_reward_modules(",".join(modules))
    conn.send({"ready": os.getpid()})
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            reply: dict[str, Any] = {"ok": True, **call_reward(request)}
        except Exception as exc:  # a failing reward is a status, and the worker lives on
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        conn.send(reply)


class _Worker:
    def __init__(self, modules: Sequence[str]) -> None:
        self.conn, child_conn = _CTX.Pipe(duplex=True)
        self.process: BaseProcess = _CTX.Process(
            target=_worker_main, args=(child_conn, tuple(modules)), daemon=True, name="jetroll-reward-worker"
        )
        self.process.start()
        # Close our copy of the child's end so that the worker's death shows up as EOF on self.conn.
        child_conn.close()
        self.is_ready = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


async def _recv(conn: Connection, timeout_s: float) -> Any:
    """Wait for one message without blocking the event loop; raises TimeoutError or EOFError."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await asyncio.wait_for(readable, timeout_s)
    finally:
        loop.remove_reader(fd)
    return conn.recv()


class RewardPool:
    """`num_workers` reward processes; `score` runs one call with a timeout, killing and replacing on overrun.

    Use one pool from one event loop. `modules` are extra modules each worker imports so that rewards they
    register with `@reward` can be called by name.
    """

    def __init__(
        self, num_workers: int, timeout_s: float, modules: Sequence[str] = (), startup_timeout_s: float = 60.0
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        import_reward_modules(",".join(modules))  # fail here, not in every worker
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.modules = tuple(modules)
        self.num_replaced = 0
        self._workers = [_Worker(self.modules) for _ in range(num_workers)]
        self._free: asyncio.Queue[_Worker] = asyncio.Queue()
        for worker in self._workers:
            self._free.put_nowait(worker)
        self._closed = False

    def worker_pids(self) -> list[int | None]:
        """The current worker process ids (a replaced worker gets a new one)."""
        return [w.pid for w in self._workers]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self.modules)
        self._workers[self._workers.index(worker)] = fresh
        self.num_replaced += 1
        return fresh

    async def score(
        self, reward_name: str, completion: str, answer: str
    ) -> tuple[PoolStatus, RewardOutput | None, str]:
        """Run reward `reward_name` on one completion.

        Returns ("ok", output, "") or ("timeout" | "error", None, detail); it never raises for a bad reward.
        """
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        worker = await self._free.get()
        healthy = False
        try:
            if not worker.is_ready:
                try:
                    await _recv(worker.conn, self.startup_timeout_s)
                except (TimeoutError, EOFError, OSError):
                    code = worker.process.exitcode
                    return "error", None, f"reward worker failed to start (exit code {code})"
                worker.is_ready = True
            request = {"reward": reward_name, "completion": completion, "answer": answer}
            try:
                worker.conn.send(request)
                reply = await _recv(worker.conn, self.timeout_s)
            except TimeoutError:
                return "timeout", None, f"reward {reward_name!r} exceeded {self.timeout_s}s; worker replaced"
            except (EOFError, OSError):
                worker.process.join(timeout=1)
                return "error", None, f"reward worker died (exit code {worker.process.exitcode}); replaced"
            healthy = True
            if reply["ok"]:
                out = RewardOutput(reward=reply["reward"], correct=reply["correct"], details=reply["details"])
                return "ok", out, ""
            return "error", None, reply["error"]
        finally:
            # Anything but a clean reply (timeout, death, cancellation) leaves the worker in an unknown state.
            if not healthy and not self._closed:
                worker = self._replace(worker)
            self._free.put_nowait(worker)

    def close(self) -> None:
        """Stop every worker: ask politely, then kill what is still running."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            worker.kill()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
