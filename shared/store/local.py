"""The local weight store: a directory, with LATEST moved by compare-and-swap under a file lock."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from jetroll.shared.store.base import LATEST, WeightStore, parse_number, version_name
from jetroll.shared.store.files import (
    MANIFEST,
    FileIdentity,
    Shard,
    copy_tree,
    take_tree,
    verify_files,
    write_atomic,
    write_create_only,
)

STAGING = ".staging"  # not a `v{N}` or `step{N}` name: listings skip it


class LocalWeightStore(WeightStore):
    """The embedded default: `{root}/{job_id}/weights/v{version:08d}/` and `.../checkpoints/step{step:08d}/`. The
    primitives are blocking file operations, each run in a thread."""

    def __init__(self, root: Path, job_id: str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.job_id = job_id
        self.job_dir = self.root / job_id
        self.weights_dir = self.job_dir / "weights"
        self.checkpoints_dir = self.job_dir / "checkpoints"
        self.staging_dir = self.job_dir / STAGING
        self._staging_swept = False
        self._taken: dict[FileIdentity, str] = {}  # the hashes of the last tree taken from staging

    def version_dir(self, version: int) -> Path:
        return self.weights_dir / version_name(version)

    @contextlib.asynccontextmanager
    async def _connect(self) -> AsyncIterator[None]:
        yield None

    def _where(self, key: str) -> str:
        return (self.job_dir / key).as_uri()

    async def _read(self, io: Any, key: str) -> bytes | None:
        path = self.job_dir / key
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            return None

    def _staging_root(self) -> Path:
        """Staged files live on the store's filesystem, so a publish links them in place of a copy (13 MB a step
        written and fsynced once, not twice, for the default job). The trainer is a job's one writer: what a dead
        one staged goes when the next stages."""
        if not self._staging_swept:
            shutil.rmtree(self.staging_dir, ignore_errors=True)
            self._staging_swept = True
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        return self.staging_dir

    async def _put_tree(self, io: Any, src_dir: Path, prefix: str) -> list[Shard]:
        def put() -> list[Shard]:
            dst = self.job_dir / prefix
            shutil.rmtree(dst, ignore_errors=True)  # leftovers of a write that died before its manifest
            dst.mkdir(parents=True)
            if not src_dir.resolve().is_relative_to(self.staging_dir):
                return copy_tree(src_dir, dst)
            shards, self._taken = take_tree(src_dir, dst, self._taken)
            return shards

        return await asyncio.to_thread(put)

    async def _put_create_only(self, io: Any, key: str, data: bytes) -> bool:
        path = self.job_dir / key
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            await asyncio.to_thread(write_create_only, path, data)
            return True
        except FileExistsError:
            return await self._read(io, key) == data

    def _latest_now(self) -> int | None:
        try:
            return int((self.weights_dir / LATEST).read_text().strip())
        except FileNotFoundError:
            return None

    async def _read_latest(self, io: Any) -> tuple[int | None, Any]:
        latest = await asyncio.to_thread(self._latest_now)
        return latest, latest  # the value is its own token: the swap compares it under the lock

    def _cas_latest(self, expected: int | None, new: int) -> bool:
        """Set LATEST to `new` only if it still reads `expected`; the flock serializes writers across processes."""
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        with (self.weights_dir / f"{LATEST}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._latest_now() != expected:
                return False
            write_atomic(self.weights_dir / LATEST, f"{new}\n".encode())
            return True

    async def _swap_latest(self, io: Any, token: Any, new: int) -> bool:
        return await asyncio.to_thread(self._cas_latest, token, new)

    async def _numbered(self, io: Any, prefix: str, name_prefix: str) -> list[int]:
        def numbered() -> list[int]:
            parent = self.job_dir / prefix
            if not parent.is_dir():
                return []
            found = ((parse_number(p.name, name_prefix), p) for p in parent.iterdir())
            return sorted(n for n, p in found if n is not None and (p / MANIFEST).is_file())

        return await asyncio.to_thread(numbered)

    async def _delete(self, io: Any, prefix: str) -> None:
        def delete() -> None:
            (self.job_dir / prefix / MANIFEST).unlink()
            shutil.rmtree(self.job_dir / prefix)

        await asyncio.to_thread(delete)

    async def _materialize(self, io: Any, prefix: str, shards: list[Shard], manifest: bytes, what: str) -> Path:
        """The stored dir itself, verified in place; treat it as read-only."""
        path = self.job_dir / prefix
        await asyncio.to_thread(verify_files, path, shards, what)
        return path
