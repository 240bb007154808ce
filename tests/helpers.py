"""Helpers the test modules share (pytest puts tests/ on sys.path through its conftest.py)."""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
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


async def cancel_and_wait(task: asyncio.Task[Any], what: str, timeout_s: float = 15.0) -> None:
    """Cancel `task` and wait for it to end; fail naming `what` when it does not (a swallowed cancellation)."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        pytest.fail(f"{what} did not stop within {timeout_s:.0f}s of its cancellation")


def ended(task: asyncio.Task[Any]) -> Callable[[], str]:
    """A `gone` for a task: re-raises the error it died of, or says it stopped."""

    def why() -> str:
        if not task.done():
            return ""
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        return "the task stopped"

    return why


def aof_path(redis_dir: Path) -> Path:
    """The append-only file a server under `redis_dir` writes to: Redis 7's incr file, or 6.2's one file."""
    (path,) = sorted(redis_dir.glob("appendonlydir/*.incr.aof")) or [redis_dir / "appendonly.aof"]
    return path


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value of every scalar in the TensorBoard event files under `directory` (TFRecord framing:
    length, its crc, the Event proto, its crc)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def wandb_history(directory: Path) -> list[dict[str, Any]]:
    """The history rows of the offline W&B runs under `directory`, read from their `.wandb` files: a 7-byte header,
    then LevelDB log records (32 KiB blocks; each record a crc, a length, a type: full, first, middle or last)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(directory.rglob("offline-run-*/run-*.wandb")):
        data, pos, pieces, records = path.read_bytes(), 7, b"", []
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if left < 7 or (length == 0 and kind == 0):  # a block's padding
                pos += left
                continue
            pieces, pos = pieces + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # full, or the last piece
                records.append(pieces)
                pieces = b""
        for raw in records:
            record = wandb_internal_pb2.Record.FromString(raw)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows
