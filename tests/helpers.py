"""Helpers the test modules share (pytest puts tests/ on sys.path through its conftest.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TypeVar

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
