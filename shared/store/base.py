"""The weight store's layout, manifests and interface, and the helpers both backends use.

Two backends share one layout, a local directory (local.py) and S3 (s3.py, any S3-compatible server, through
aioboto3): `{root}/{job_id}/weights/v{version:08d}/`, `{root}/{job_id}/weights/LATEST`,
`{root}/{job_id}/checkpoints/step{N}/`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

import msgspec
from botocore.exceptions import ClientError

log = logging.getLogger("jetroll.store")

MANIFEST = "manifest.json"
LATEST = "LATEST"
CHUNK_BYTES = 1 << 20
STORE_TYPES = ("local", "s3")
T = TypeVar("T")


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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def source_files(src_dir: Path) -> list[Path]:
    if not src_dir.is_dir():
        raise WeightStoreError(f"source dir {src_dir} does not exist")
    files = sorted(p for p in src_dir.rglob("*") if p.is_file() and p.relative_to(src_dir).as_posix() != MANIFEST)
    if not files:
        raise WeightStoreError(f"source dir {src_dir} holds no files")
    return files


def copy_hashed(src: Path, dst: Path) -> tuple[str, int]:
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


def copy_tree(src_dir: Path, dst_dir: Path) -> list[Shard]:
    shards = []
    for src in source_files(src_dir):
        key = src.relative_to(src_dir).as_posix()
        sha256, size_bytes = copy_hashed(src, dst_dir / key)
        shards.append(Shard(key=key, sha256=sha256, size_bytes=size_bytes))
    return shards


def check_shard(shard: Shard, size_bytes: int, sha256: str, what: str) -> None:
    if size_bytes != shard.size_bytes:
        raise WeightStoreError(f"{what}: file {shard.key} has {size_bytes} bytes, manifest says {shard.size_bytes}")
    if sha256 != shard.sha256:
        raise WeightStoreError(f"{what}: file {shard.key} fails its sha256 check")


def verify_files(root: Path, shards: list[Shard], what: str) -> None:
    for shard in shards:
        path = root / shard.key
        if not path.is_file():
            raise WeightStoreError(f"{what}: file {shard.key} is missing")
        size = path.stat().st_size
        check_shard(shard, size, sha256_of(path) if size == shard.size_bytes else "", what)


def encode_manifest(manifest: Manifest | CheckpointManifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest))


def version_name(version: int) -> str:
    return f"v{version:08d}"


def step_name(step: int) -> str:
    return f"step{step:08d}"


def parse_number(name: str, prefix: str) -> int | None:
    """The N of a `v{N}` / `step{N}` name, or None for anything else (temp dirs, locks, LATEST)."""
    digits = name.removeprefix(prefix)
    return int(digits) if name.startswith(prefix) and digits.isdigit() else None


def retention_candidates(versions: list[int], keep_last: int, latest: int | None) -> list[int]:
    """Versions retention may delete once their manifests say they are not checkpoints."""
    keep = set(versions[-keep_last:]) | {latest}
    return [v for v in versions if v not in keep]


def write_create_only(path: Path, data: bytes) -> None:
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


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but the first failure cancels the rest, so nothing writes after it propagates."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


# 412 from a condition that no longer holds, 409 when S3 sees two conditional writes race, 404 for an IfMatch on a
# key gone meanwhile: each means "someone else moved first", never a fault.
CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409"}
MISSING_CODES = {"NoSuchKey", "404"}


def read_part(f: BinaryIO, size_bytes: int, digest: Any) -> bytes:
    chunk = f.read(size_bytes)
    digest.update(chunk)
    return chunk
