"""The weight store's layout, manifests and interface.

Two backends share one layout, a local directory (local.py) and S3 (s3.py, any S3-compatible server, through
aioboto3): `{root}/{job_id}/weights/v{version:08d}/`, `{root}/{job_id}/weights/LATEST`,
`{root}/{job_id}/checkpoints/step{N}/` (the trainer's state after step N), and
`{root}/{job_id}/steps/v{N}/manifest.json` (what step N trained: an append-only record, never retained away).
Files are hashed, copied (or linked, when staged in the local store's `.staging/`), verified and written by files.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from jetroll.shared.numerics import QuantizationPlan
from jetroll.shared.store.files import MANIFEST, Shard, WeightStoreError, tree_sha256

log = logging.getLogger("jetroll.store")

LATEST = "LATEST"
STORE_TYPES = ("local", "s3")
T = TypeVar("T")


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a published weight version holds; every file but the manifest is listed with its sha256."""

    version: int
    step: int
    shards: list[Shard]
    precision_id: str
    dtype: str
    parent: int | None
    created_at: float
    is_checkpoint: bool = False
    quantization_plan: QuantizationPlan | None = None  # the trainer's; rollout refuses a version without one


class CheckpointManifest(msgspec.Struct, frozen=True):
    """The file list of a trainer checkpoint (master weights, optimizer, RNG, ledger)."""

    step: int
    shards: list[Shard]
    created_at: float


class StepRecord(msgspec.Struct, frozen=True):
    """What one surviving trainer step trained: the groups (id -> samples) that made `version`. Written once per
    version, after the trainer state of that version is durable; the audit counts a group trained twice from these."""

    version: int
    groups: dict[str, int]
    created_at: float


class WeightStore(ABC):
    """Where the trainer publishes weight versions and checkpoints and rollout workers fetch them.

    The algorithm is written once here, over a backend's few primitives. Keys are relative to the job's root
    (`weights/v00000001/manifest.json`, `weights/LATEST`, `checkpoints/step00000020/...`), and each primitive takes
    the handle `_connect()` opened for the operation (an S3 client; nothing for a local directory).
    """

    # --- the primitives a backend provides ---

    @abstractmethod
    def _connect(self) -> AbstractAsyncContextManager[Any]: ...

    @abstractmethod
    async def _read(self, io: Any, key: str) -> bytes | None:
        """The bytes at `key`, or None when there are none."""

    @abstractmethod
    async def _put_tree(self, io: Any, src_dir: Path, prefix: str) -> list[Shard]:
        """Copy `src_dir`'s files under `prefix`, hashing each byte once, over whatever a dead writer left there."""

    @abstractmethod
    async def _put_create_only(self, io: Any, key: str, data: bytes) -> bool:
        """Write `key` unless it exists; False when it holds other bytes (a retried write of ours counts as won)."""

    @abstractmethod
    async def _read_latest(self, io: Any) -> tuple[int | None, Any]:
        """LATEST (None before the first publish) and the token its swap needs."""

    @abstractmethod
    async def _swap_latest(self, io: Any, token: Any, new: int) -> bool:
        """Set LATEST to `new` unless it moved since `token` was read."""

    @abstractmethod
    async def _numbered(self, io: Any, prefix: str, name_prefix: str) -> list[int]:
        """N of every `{prefix}/{name_prefix}{N}/manifest.json`, ascending: the published versions or checkpoints."""

    @abstractmethod
    async def _delete(self, io: Any, prefix: str) -> None:
        """Delete what lies under `prefix`, its manifest first, so a half-deleted version never looks published."""

    @abstractmethod
    async def _materialize(self, io: Any, prefix: str, shards: list[Shard], manifest: bytes, what: str) -> Path:
        """A local dir holding `prefix`'s files, every size and sha256 verified; WeightStoreError otherwise."""

    @abstractmethod
    def _where(self, key: str) -> str:
        """Where `key` lives, for messages and the `weights` event."""

    def _staging_root(self) -> Path | None:
        """Where `staging` makes its dirs: the system's temp dir unless a backend can keep files staged nearer."""
        return None

    # --- the algorithm ---

    @contextlib.asynccontextmanager
    async def staging(self) -> AsyncIterator[Path]:
        """A fresh local dir to write a publish's or checkpoint's files in, removed afterwards. The local store keeps
        files staged here by hard link instead of a copy: write each one whole before handing it over, never after."""
        directory = Path(tempfile.mkdtemp(prefix="jetroll-staging-", dir=self._staging_root()))
        try:
            yield directory
        finally:
            await asyncio.to_thread(shutil.rmtree, directory, True)

    def uri(self, version: int) -> str:
        """Where the version's manifest lives, for the `weights` event."""
        return self._where(f"weights/{version_name(version)}/{MANIFEST}")

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
        quantization_plan: QuantizationPlan | None = None,
    ) -> Manifest:
        """Copy `src_dir`'s files, write the manifest create-only, then move LATEST forward (never back). A version
        already published with these very files is a retry whose last try died before LATEST: it finishes that."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        prefix = f"weights/{version_name(version)}"
        async with self._connect() as io:
            if (raw := await self._read(io, f"{prefix}/{MANIFEST}")) is not None:
                manifest = self._decode_manifest(raw, version)
                files = await asyncio.to_thread(tree_sha256, Path(src_dir))
                if ({s.key: s.sha256 for s in manifest.shards}, manifest.precision_id, manifest.dtype,
                        manifest.quantization_plan) != (files, precision_id, dtype, quantization_plan):
                    raise WeightStoreError(f"version {version} is already published with other weights "
                                           f"({self.uri(version)})")
            else:
                manifest = Manifest(version=version, step=step, shards=await self._put_tree(io, Path(src_dir), prefix),
                                    precision_id=precision_id, dtype=dtype, parent=parent, created_at=time.time(),
                                    is_checkpoint=is_checkpoint, quantization_plan=quantization_plan)
                if not await self._put_create_only(io, f"{prefix}/{MANIFEST}", encode_manifest(manifest)):
                    raise WeightStoreError(f"version {version} was published concurrently ({self.uri(version)})")
            while True:
                latest, token = await self._read_latest(io)
                if latest is not None and latest >= version or await self._swap_latest(io, token, version):
                    return manifest

    async def latest(self) -> int | None:
        """The LATEST version, or None before the first publish."""
        async with self._connect() as io:
            return (await self._read_latest(io))[0]

    async def _manifest(self, io: Any, version: int) -> tuple[Manifest, bytes]:
        raw = await self._read(io, f"weights/{version_name(version)}/{MANIFEST}")
        if raw is None:
            raise WeightStoreError(f"version {version} is not published (no {self.uri(version)})")
        return self._decode_manifest(raw, version), raw

    def _decode_manifest(self, raw: bytes, version: int) -> Manifest:
        try:
            return msgspec.json.decode(raw, type=Manifest)
        except msgspec.DecodeError as exc:
            raise WeightStoreError(f"version {version}: bad manifest {self.uri(version)}: {exc}") from None

    async def manifest(self, version: int) -> Manifest:
        async with self._connect() as io:
            return (await self._manifest(io, version))[0]

    async def fetch(self, version: int) -> Path:
        """A local dir with the version's files, every sha256 and size verified; WeightStoreError otherwise."""
        async with self._connect() as io:
            manifest, raw = await self._manifest(io, version)
            return await self._materialize(io, f"weights/{version_name(version)}", manifest.shards, raw,
                                           f"version {version}")

    async def versions(self) -> list[int]:
        """Published versions (those with a manifest), ascending."""
        async with self._connect() as io:
            return await self._numbered(io, "weights", "v")

    async def retain(self, keep_last: int) -> list[int]:
        """Delete versions older than the newest `keep_last`, sparing checkpoint ones and LATEST."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        deleted = []
        async with self._connect() as io:
            versions, (latest, _) = await self._numbered(io, "weights", "v"), await self._read_latest(io)
            for version in retention_candidates(versions, keep_last, latest):
                if not (await self._manifest(io, version))[0].is_checkpoint:
                    await self._delete(io, f"weights/{version_name(version)}")
                    deleted.append(version)
        return deleted

    async def save_checkpoint(self, step: int, src_dir: Path) -> None:
        """The files, then the manifest create-only: a checkpoint without its manifest does not exist."""
        prefix = f"checkpoints/{step_name(step)}"
        async with self._connect() as io:
            if await self._read(io, f"{prefix}/{MANIFEST}") is not None:
                raise WeightStoreError(f"checkpoint for step {step} already exists ({self._where(prefix)})")
            manifest = CheckpointManifest(step=step, shards=await self._put_tree(io, Path(src_dir), prefix),
                                          created_at=time.time())
            if not await self._put_create_only(io, f"{prefix}/{MANIFEST}", encode_manifest(manifest)):
                raise WeightStoreError(f"checkpoint for step {step} was saved concurrently ({self._where(prefix)})")

    async def checkpoints(self) -> list[int]:
        """Steps with a saved checkpoint (those with a manifest), ascending."""
        async with self._connect() as io:
            return await self._numbered(io, "checkpoints", "step")

    async def retain_checkpoints(self, keep_last: int, keep_every: int) -> list[int]:
        """Delete every checkpoint but the newest `keep_last` and the multiples of `keep_every`; returns the steps
        deleted."""
        if keep_last < 1 or keep_every < 1:
            raise ValueError(f"keep_last and keep_every must be >= 1, got {keep_last} and {keep_every}")
        async with self._connect() as io:
            steps = await self._numbered(io, "checkpoints", "step")
            deleted = [step for step in steps[:-keep_last] if step % keep_every]
            for step in deleted:
                await self._delete(io, f"checkpoints/{step_name(step)}")
        return deleted

    async def record_step(self, record: StepRecord) -> None:
        """Append what step `record.version` trained, create-only: a retried write of the same groups wins, another
        set of groups under that version is refused."""
        key = f"steps/{version_name(record.version)}/{MANIFEST}"
        async with self._connect() as io:
            if await self._put_create_only(io, key, msgspec.json.encode(record)):
                return
            stored = msgspec.json.decode(await self._read(io, key) or b"{}", type=StepRecord)
            if stored.groups != record.groups:
                raise WeightStoreError(f"step {record.version} is recorded with other groups ({self._where(key)})")

    async def step_records(self, after: int = -1) -> list[StepRecord]:
        """The step records of versions above `after`, ascending."""
        async with self._connect() as io:
            records = []
            for version in await self._numbered(io, "steps", "v"):
                if version > after:
                    key = f"steps/{version_name(version)}/{MANIFEST}"
                    try:
                        records.append(msgspec.json.decode(await self._read(io, key) or b"", type=StepRecord))
                    except msgspec.DecodeError as exc:
                        raise WeightStoreError(f"bad step record {self._where(key)}: {exc}") from None
            return records

    async def latest_checkpoint(self) -> tuple[int, Path] | None:
        """(step, dir) of the newest checkpoint that verifies, or None."""
        async with self._connect() as io:
            for step in reversed(await self._numbered(io, "checkpoints", "step")):
                prefix = f"checkpoints/{step_name(step)}"
                try:
                    raw = await self._read(io, f"{prefix}/{MANIFEST}")
                    if raw is None:
                        raise WeightStoreError("its manifest vanished")
                    manifest = msgspec.json.decode(raw, type=CheckpointManifest)
                    path = await self._materialize(io, prefix, manifest.shards, raw, f"checkpoint step {step}")
                except (OSError, msgspec.DecodeError, WeightStoreError) as exc:
                    log.warning("skipping checkpoint %s: %s", self._where(prefix), exc)
                    continue
                return step, path
        return None


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
