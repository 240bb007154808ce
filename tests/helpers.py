"""Helpers the test modules share (pytest puts tests/ on sys.path through its conftest.py)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

JETROLL = [sys.executable, "-m", "jetroll.services.cli"]  # the CLI, as a subprocess of the interpreter under test


def wait_until(predicate: Callable[[], T | None], what: str, timeout_s: float, *, interval_s: float = 0.1,
               gone: Callable[[], str] = str, context: Callable[[], str] = str) -> T:
    """Poll `predicate` until it returns something truthy, and return that. Fail naming `what` after `timeout_s`, or
    as soon as `gone()` says why the thing waited on cannot come (a process exited); `context()` adds its logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        if why := gone():
            pytest.fail(f"{why} while waiting for {what}\n{context()}")
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{context()}")


async def wait_until_async(predicate: Callable[[], Awaitable[T | None]], what: str, timeout_s: float, *,
                           interval_s: float = 0.05, gone: Callable[[], str] = str,
                           context: Callable[[], str] = str) -> T:
    """`wait_until` for a coroutine predicate, polling on the event loop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := await predicate():
            return value
        if why := gone():
            pytest.fail(f"{why} while waiting for {what}\n{context()}")
        await asyncio.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}\n{context()}")


def ended(task: asyncio.Task[Any]) -> Callable[[], str]:
    """A `gone` for a task: re-raises the error it died of, or says it stopped."""

    def why() -> str:
        if not task.done():
            return ""
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        return "the task stopped"

    return why
