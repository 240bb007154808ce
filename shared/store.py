"""The weight store: versioned HF-format model dirs with sha256 manifests, a forward-only LATEST, checkpoints."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Protocol

import msgspec

from shared.config import StoreConfig

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "LATEST"
CHUNK_BYTES = 1 << 20
STORE_TYPES = ("local",)


class WeightStoreError(RuntimeError):
    """A version or checkpoint that cannot be published or trusted; readers keep serving the old one."""


class Shard(msgspec.Struct, frozen=True):
    key: str  # path relative to the version dir, '/'-separated
    sha256: str
    size_bytes: int


class Manifest(msgspec.Struct, frozen=True):
    """What a published weight version holds; every file but the manifest is listed with its sha256."""

    version: int
    step: int
    shards: list[Shard]
    precision_id: str
    dtype: str
    parent: int | None
    created_at: float
    is_checkpoint: bool = False


class CheckpointManifest(msgspec.Struct, frozen=True):
    """The file list of a trainer checkpoint (master weights, optimizer, RNG, ledger)."""

    step: int
    shards: list[Shard]
    created_at: float


class WeightStore(Protocol):
    """Where the trainer publishes weight versions and checkpoints and rollout workers fetch them."""

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
        """Copy `src_dir`'s files, write the manifest create-only, then move LATEST forward (never back)."""
        ...

    async def latest(self) -> int | None:
        """The LATEST version, or None before the first publish."""
        ...

    async def manifest(self, version: int) -> Manifest: ...

    async def fetch(self, version: int) -> Path:
        """A local dir with the version's files, every sha256 and size verified; WeightStoreError otherwise."""
        ...

    async def versions(self) -> list[int]:
        """Published versions (those with a manifest), ascending."""
        ...

    async def retain(self, keep_last: int) -> list[int]:
        """Delete versions older than the newest `keep_last`, sparing checkpoint ones and LATEST."""
        ...

    def uri(self, version: int) -> str:
        """Where the version's manifest lives, for the `weights` event."""
        ...

    async def save_checkpoint(self, step: int, src_dir: Path) -> None:
        """Store a trainer checkpoint atomically: it is either whole or absent."""
        ...

    async def latest_checkpoint(self) -> tuple[int, Path] | None:
        """(step, dir) of the newest checkpoint that verifies, or None."""
        ...


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _source_files(src_dir: Path) -> list[Path]:
    if not src_dir.is_dir():
        raise WeightStoreError(f"source dir {src_dir} does not exist")
    files = sorted(p for p in src_dir.rglob("*") if p.is_file() and p.relative_to(src_dir).as_posix() != MANIFEST)
    if not files:
        raise WeightStoreError(f"source dir {src_dir} holds no files")
    return files


def _copy_hashed(src: Path, dst: Path) -> tuple[str, int]:
    """Copy one file, hashing the bytes as they are written, and fsync it; returns (sha256, size_bytes)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    size = 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(CHUNK_BYTES):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return digest.hexdigest(), size


def _copy_tree(src_dir: Path, dst_dir: Path) -> list[Shard]:
    shards = []
    for src in _source_files(src_dir):
        key = src.relative_to(src_dir).as_posix()
        sha256, size_bytes = _copy_hashed(src, dst_dir / key)
        shards.append(Shard(key=key, sha256=sha256, size_bytes=size_bytes))
    return shards


def _verify(root: Path, shards: list[Shard], what: str) -> None:
    for shard in shards:
        path = root / shard.key
        if not path.is_file():
            raise WeightStoreError(f"{what}: file {shard.key} is missing")
        size = path.stat().st_size
        if size != shard.size_bytes:
            raise WeightStoreError(f"{what}: file {shard.key} has {size} bytes, manifest says {shard.size_bytes}")
        if _sha256(path) != shard.sha256:
            raise WeightStoreError(f"{what}: file {shard.key} fails its sha256 check")


def _write_create_only(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, failing with FileExistsError if it exists (temp file + hard link)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    finally:
        tmp.unlink()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class LocalWeightStore:
    """The embedded default: `{root}/{job_id}/weights/v{version:08d}/` and `.../checkpoints/step{step:08d}/`."""

    def __init__(self, root: Path, job_id: str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.job_id = job_id
        self.weights_dir = self.root / job_id / "weights"
        self.checkpoints_dir = self.root / job_id / "checkpoints"

    def version_dir(self, version: int) -> Path:
        return self.weights_dir / f"v{version:08d}"

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
            shards=_copy_tree(src_dir, vdir),
            precision_id=precision_id,
            dtype=dtype,
            parent=parent,
            created_at=time.time(),
            is_checkpoint=is_checkpoint,
        )
        try:
            _write_create_only(manifest_path, msgspec.json.format(msgspec.json.encode(manifest)))
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
            _write_atomic(self.weights_dir / LATEST, f"{new}\n".encode())
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
        _verify(self.version_dir(version), manifest.shards, f"version {version}")
        return self.version_dir(version)

    async def versions(self) -> list[int]:
        return await asyncio.to_thread(self._versions)

    def _versions(self) -> list[int]:
        if not self.weights_dir.is_dir():
            return []
        return sorted(
            int(p.name[1:])
            for p in self.weights_dir.iterdir()
            if p.name.startswith("v") and p.name[1:].isdigit() and (p / MANIFEST).is_file()
        )

    async def retain(self, keep_last: int) -> list[int]:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        return await asyncio.to_thread(self._retain, keep_last)

    def _retain(self, keep_last: int) -> list[int]:
        versions = self._versions()
        keep = set(versions[-keep_last:]) | {self._read_latest()}
        deleted = []
        for version in versions:
            if version in keep or self._manifest(version).is_checkpoint:
                continue
            # Drop the manifest first so a half-deleted version never looks published.
            (self.version_dir(version) / MANIFEST).unlink()
            shutil.rmtree(self.version_dir(version))
            deleted.append(version)
        return deleted

    async def save_checkpoint(self, step: int, src_dir: Path) -> None:
        await asyncio.to_thread(self._save_checkpoint, step, Path(src_dir))

    def _save_checkpoint(self, step: int, src_dir: Path) -> None:
        final = self.checkpoints_dir / f"step{step:08d}"
        if final.exists():
            raise WeightStoreError(f"checkpoint for step {step} already exists ({final})")
        tmp = self.checkpoints_dir / f".step{step:08d}.tmp-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        try:
            manifest = CheckpointManifest(step=step, shards=_copy_tree(src_dir, tmp), created_at=time.time())
            _write_atomic(tmp / MANIFEST, msgspec.json.format(msgspec.json.encode(manifest)))
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
            (
                int(p.name[4:])
                for p in self.checkpoints_dir.iterdir()
                if p.name.startswith("step") and p.name[4:].isdigit()
            ),
            reverse=True,
        )
        for step in steps:
            path = self.checkpoints_dir / f"step{step:08d}"
            try:
                manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=CheckpointManifest)
                _verify(path, manifest.shards, f"checkpoint step {step}")
            except (OSError, msgspec.DecodeError, WeightStoreError) as exc:
                log.warning("skipping checkpoint %s: %s", path, exc)
                continue
            return step, path
        return None


def setup_store(config: StoreConfig, job_id: str, run_dir: Path) -> WeightStore:
    """Build the configured store; an empty root means `<run_dir>/store`."""
    if config.type == "local":
        root = Path(config.root).expanduser() if config.root else Path(run_dir) / "store"
        return LocalWeightStore(root, job_id)
    raise ValueError(f"unknown store type {config.type!r}; valid: {list(STORE_TYPES)}")
