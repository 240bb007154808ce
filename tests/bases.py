"""The tests' base models, built once per machine into one cache behind a lock, so that parallel pytest workers and
later runs share them. A base is checked against the sha256 of its files when it was built, and rebuilt if a test
changed it, so one test's damage never reaches another run."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# JETROLL_TEST_MODEL_CACHE moves it (a cold cache: point it at an empty folder)
TEST_MODEL_CACHE = Path(os.environ.get("JETROLL_TEST_MODEL_CACHE", "~/.cache/jetroll/tests")).expanduser()


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """One builder of `name` at a time on this machine, across pytest workers and runs."""
    TEST_MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with (TEST_MODEL_CACHE / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def file_digests(directory: Path) -> dict[str, str]:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def shared_base(name: str, build: Callable[[], Path]) -> Path:
    """The model dir `build()` makes in TEST_MODEL_CACHE, built at most once per machine and verified on reuse."""
    with build_lock(name):
        record = TEST_MODEL_CACHE / f".{name}.sha256.json"
        if record.is_file():
            built = json.loads(record.read_text())
            path = Path(built["path"])
            if path.is_dir() and file_digests(path) == built["files"]:
                return path
            shutil.rmtree(path, ignore_errors=True)  # changed since it was built: build it again
        path = build()
        record.write_text(json.dumps({"path": str(path), "files": file_digests(path)}))
        return path
