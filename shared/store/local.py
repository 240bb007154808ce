"""The local weight store: a directory, with LATEST moved by compare-and-swap under a file lock."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import time
import uuid
from pathlib import Path

import msgspec

from jetroll.shared.store.base import (
    LATEST,
    MANIFEST,
    CheckpointManifest,
    Manifest,
    WeightStoreError,
    copy_tree,
    encode_manifest,
    log,
    parse_number,
    retention_candidates,
    step_name,
    verify_files,
    version_name,
    write_atomic,
    write_create_only,
)


class LocalWeightStore:
    """The embedded default: `{root}/{job_id}/weights/v{version:08d}/` and `.../checkpoints/step{step:08d}/`."""

    def __init__(self, root: Path, job_id: str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.job_id = job_id
        self.weights_dir = self.root / job_id / "weights"
        self.checkpoints_dir = self.root / job_id / "checkpoints"

    def version_dir(self, version: int) -> Path:
        return self.weights_dir / version_name(version)

    def uri(self, version: int) -> str:
        return (self.version_dir(version) / MANIFEST).as_uri()

    async def publish(
        self,
        version: int,
        step: int,
        src_dir: Path,
        *,
        precision_id: str,
        dtype: str,
        parent: int | None,
        is_checkpoint: bool = False,
    ) -> Manifest:
        return await asyncio.to_thread(
            self._publish, version, step, Path(src_dir), precision_id, dtype, parent, is_checkpoint
        )

    def _publish(
        self,
        version: int,
        step: int,
        src_dir: Path,
        precision_id: str,
        dtype: str,
        parent: int | None,
        is_checkpoint: bool,
    ) -> Manifest:
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        vdir = self.version_dir(version)
        manifest_path = vdir / MANIFEST
        if manifest_path.exists():
            raise WeightStoreError(f"version {version} is already published ({manifest_path})")
        if vdir.exists():
            shutil.rmtree(vdir)  # leftovers of a publish that crashed before its manifest
        vdir.mkdir(parents=True)
        manifest = Manifest(
            version=version,
            step=step,
            shards=copy_tree(src_dir, vdir),
            precision_id=precision_id,
            dtype=dtype,
            parent=parent,
            created_at=time.time(),
            is_checkpoint=is_checkpoint,
        )
        try:
            write_create_only(manifest_path, encode_manifest(manifest))
        except FileExistsError:
            raise WeightStoreError(f"version {version} was published concurrently ({manifest_path})") from None
        while True:
            expected = self._read_latest()
            if expected is not None and expected >= version:
                break
            if self._cas_latest(expected, version):
                break
        return manifest

    def _read_latest(self) -> int | None:
        try:
            return int((self.weights_dir / LATEST).read_text().strip())
        except FileNotFoundError:
            return None

    def _cas_latest(self, expected: int | None, new: int) -> bool:
        """Set LATEST to `new` only if it still reads `expected`; the flock serializes writers across processes."""
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        with (self.weights_dir / f"{LATEST}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._read_latest() != expected:
                return False
            write_atomic(self.weights_dir / LATEST, f"{new}\n".encode())
            return True

    async def latest(self) -> int | None:
        return await asyncio.to_thread(self._read_latest)

    async def manifest(self, version: int) -> Manifest:
        return await asyncio.to_thread(self._manifest, version)

    def _manifest(self, version: int) -> Manifest:
        path = self.version_dir(version) / MANIFEST
        try:
            return msgspec.json.decode(path.read_bytes(), type=Manifest)
        except FileNotFoundError:
            raise WeightStoreError(f"version {version} is not published (no {path})") from None
        except msgspec.DecodeError as exc:
            raise WeightStoreError(f"version {version}: bad manifest {path}: {exc}") from None

    async def fetch(self, version: int) -> Path:
        """The version dir itself, after verification; treat it as read-only."""
        return await asyncio.to_thread(self._fetch, version)

    def _fetch(self, version: int) -> Path:
        manifest = self._manifest(version)
        verify_files(self.version_dir(version), manifest.shards, f"version {version}")
        return self.version_dir(version)

    async def versions(self) -> list[int]:
        return await asyncio.to_thread(self._versions)

    def _versions(self) -> list[int]:
        if not self.weights_dir.is_dir():
            return []
        numbered = ((parse_number(p.name, "v"), p) for p in self.weights_dir.iterdir())
        return sorted(v for v, p in numbered if v is not None and (p / MANIFEST).is_file())

    async def retain(self, keep_last: int) -> list[int]:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        return await asyncio.to_thread(self._retain, keep_last)

    def _retain(self, keep_last: int) -> list[int]:
        deleted = []
        for version in retention_candidates(self._versions(), keep_last, self._read_latest()):
            if self._manifest(version).is_checkpoint:
                continue
            # Drop the manifest first so a half-deleted version never looks published.
            (self.version_dir(version) / MANIFEST).unlink()
            shutil.rmtree(self.version_dir(version))
            deleted.append(version)
        return deleted

    async def save_checkpoint(self, step: int, src_dir: Path) -> None:
        await asyncio.to_thread(self._save_checkpoint, step, Path(src_dir))

    def _save_checkpoint(self, step: int, src_dir: Path) -> None:
        final = self.checkpoints_dir / step_name(step)
        if final.exists():
            raise WeightStoreError(f"checkpoint for step {step} already exists ({final})")
        tmp = self.checkpoints_dir / f".{final.name}.tmp-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        try:
            manifest = CheckpointManifest(step=step, shards=copy_tree(src_dir, tmp), created_at=time.time())
            write_atomic(tmp / MANIFEST, encode_manifest(manifest))
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    async def latest_checkpoint(self) -> tuple[int, Path] | None:
        return await asyncio.to_thread(self._latest_checkpoint)

    def _latest_checkpoint(self) -> tuple[int, Path] | None:
        if not self.checkpoints_dir.is_dir():
            return None
        steps = sorted(
            (s for p in self.checkpoints_dir.iterdir() if (s := parse_number(p.name, "step")) is not None), reverse=True
        )
        for step in steps:
            path = self.checkpoints_dir / step_name(step)
            try:
                manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=CheckpointManifest)
                verify_files(path, manifest.shards, f"checkpoint step {step}")
            except (OSError, msgspec.DecodeError, WeightStoreError) as exc:
                log.warning("skipping checkpoint %s: %s", path, exc)
                continue
            return step, path
        return None
