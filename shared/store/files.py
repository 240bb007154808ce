"""Files of the weight store: hashed as they are copied, verified against their manifest, written whole or not at
all."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import msgspec

MANIFEST = "manifest.json"  # a version's or checkpoint's own file, never one of its shards
CHUNK_BYTES = 1 << 20


class WeightStoreError(RuntimeError):
    """A version or checkpoint that cannot be published or trusted; readers keep serving the old one."""


class Shard(msgspec.Struct, frozen=True):
    key: str  # path relative to the version dir, '/'-separated
    sha256: str
    size_bytes: int


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return _read_sha256(f)


def _read_sha256(f: BinaryIO) -> str:
    """sha256 of what is left to read in `f`, read in chunks."""
    digest = hashlib.sha256()
    while chunk := f.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def tree_sha256(src_dir: Path) -> dict[str, str]:
    """sha256 of each file a publish of `src_dir` would upload, by its key."""
    return {src.relative_to(src_dir).as_posix(): sha256_of(src) for src in source_files(src_dir)}


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


FileIdentity = tuple[int, int, int, int]  # device, inode, size, mtime: one file's bytes, whatever its names


def take_tree(src_dir: Path, dst_dir: Path,
              hashed_before: Mapping[FileIdentity, str]) -> tuple[list[Shard], dict[FileIdentity, str]]:
    """Place `src_dir`'s files under `dst_dir` by hard link, each hashed and fsynced where it is: for files written
    on the store's own filesystem for the store to keep. Files that are links of one another stay one file, hashed
    once: `hashed_before` holds the sha256 of the files of the tree taken before (a version's model is its
    checkpoint's, linked). Returns the shards and this tree's hashes."""
    shards, hashed = [], {}
    for src in source_files(src_dir):
        key = src.relative_to(src_dir).as_posix()
        with src.open("rb") as f:
            stat = os.fstat(f.fileno())
            identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if identity in hashed_before:  # synced too, when it was taken
                hashed[identity] = hashed_before[identity]
            elif identity not in hashed:
                hashed[identity] = _read_sha256(f)
                os.fsync(f.fileno())
        dst = dst_dir / key
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
        shards.append(Shard(key=key, sha256=hashed[identity], size_bytes=stat.st_size))
    return shards, hashed


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


def write_create_only(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, failing with FileExistsError if it exists (temp file + hard link)."""
    _write_through_temp(path, data, os.link)


def write_atomic(path: Path, data: bytes) -> None:
    _write_through_temp(path, data, os.replace)


def _write_through_temp(path: Path, data: bytes, place: Callable[[Path, Path], None]) -> None:
    """Write and fsync a temp file beside `path`, then `place` it there; the temp file never stays behind, even
    when the disk is full."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        place(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
