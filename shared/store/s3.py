"""The S3 weight store (any S3-compatible server, through aioboto3)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, BinaryIO

from botocore.exceptions import BotoCoreError, ClientError

from jetroll.shared.store.base import LATEST, WeightStore, gather_all, log, parse_number
from jetroll.shared.store.files import (
    CHUNK_BYTES,
    MANIFEST,
    Shard,
    WeightStoreError,
    check_shard,
    source_files,
    verify_files,
)


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


class S3WeightStore(WeightStore):
    """The LocalWeightStore layout under `s3://{bucket}/{prefix}/`; fetched versions land in a local cache dir.

    Publish uploads the shards (multipart above `multipart_threshold_bytes`, hashing each byte once as it is read),
    writes the manifest create-only (`IfNoneMatch="*"`), then moves LATEST forward by compare-and-swap on its ETag
    (`IfMatch`). Fetch streams each shard into the cache, hashing as it writes, and renames the dir into place only
    once every sha256 matches. Credentials come from `session` (an aioboto3.Session) or else the AWS default chain.
    A version number has one publisher (the trainer): two publishers of one number are told apart by the
    manifest, but the loser's shard uploads may already have replaced the winner's, which readers then refuse.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str,
        job_id: str,
        cache_root: Path,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        session: Any = None,
        # rclone's default cutoff; below it one PUT beats parallel parts on a single-host server such as moto,
        # whose CompleteMultipartUpload copies the whole object again
        multipart_threshold_bytes: int = 200 << 20,
        part_bytes: int = 16 << 20,
        max_concurrency: int = 8,
        num_cached_versions: int = 3,
        max_attempts: int = 12,
    ) -> None:
        assert part_bytes >= 5 << 20, "S3 parts other than the last must be at least 5 MiB"
        self.bucket = bucket
        self.job_id = job_id
        self.endpoint_url = endpoint_url
        self.region = region
        self.multipart_threshold_bytes = multipart_threshold_bytes
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency
        self.num_cached_versions = num_cached_versions
        self.max_attempts = max_attempts
        self._session = session
        self.job_prefix = "/".join(p for p in (prefix.strip("/"), job_id) if p)
        self.weights_prefix = f"{self.job_prefix}/weights"
        self.cache_dir = Path(cache_root).expanduser().resolve() / job_id / "s3-cache"

    def client(self) -> Any:
        """An S3 client with the store's settings, for `async with`: one per operation, because an aiohttp
        session belongs to one event loop and the store outlives loops."""
        import aioboto3
        from botocore.config import Config

        if self._session is None:
            self._session = aioboto3.Session()
        config = Config(
            s3={"addressing_style": "path"} if self.endpoint_url else None,  # MinIO and moto serve path-style
            max_pool_connections=self.max_concurrency,
            retries={"mode": "standard", "total_max_attempts": self.max_attempts},
            # our sha256 covers every byte end to end; botocore's default CRC32 would be one more pass per side
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return self._session.client("s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config)

    def _key(self, key: str) -> str:
        return f"{self.job_prefix}/{key}"

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    @contextlib.asynccontextmanager
    async def _connect(self) -> Any:
        """A client for one operation; an S3 failure that outlasts the retries surfaces as a WeightStoreError."""
        try:
            async with self.client() as s3:
                yield s3
        except (BotoCoreError, ClientError) as exc:
            raise WeightStoreError(f"S3 request to {self.endpoint_url or 'AWS'} failed: {exc}") from exc

    async def _get_bytes(self, s3: Any, key: str) -> tuple[bytes, str] | None:
        """(body, ETag) of `key`, or None when it does not exist. A body cut off mid-read is read again: botocore
        retries requests, not the reading of their bodies, and a connection lost there is no more fatal."""
        from aiohttp import ClientError as BodyReadError

        attempt = 0
        while True:
            attempt += 1
            try:
                response = await s3.get_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if error_code(exc) in MISSING_CODES:
                    return None
                raise
            body = response["Body"]
            try:
                async with body:
                    return await body.read(), response["ETag"]
            except BodyReadError as exc:
                if attempt == self.max_attempts:
                    raise WeightStoreError(f"reading s3://{self.bucket}/{key} failed {attempt} times: {exc}") from exc
                log.warning("reading s3://%s/%s failed (%s); reading it again", self.bucket, key, exc)
                await asyncio.sleep(min(2.0**attempt, 20.0))

    async def _keys(self, s3: Any, prefix: str) -> list[str]:
        paginator = s3.get_paginator("list_objects_v2")
        return [
            obj["Key"]
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix)
            for obj in page.get("Contents", [])
        ]

    async def _upload_tree(self, s3: Any, src_dir: Path, prefix: str) -> list[Shard]:
        files = source_files(src_dir)
        slots = asyncio.Semaphore(self.max_concurrency)
        return await gather_all(
            self._upload(s3, path, path.relative_to(src_dir).as_posix(), prefix, slots) for path in files
        )

    async def _upload(self, s3: Any, path: Path, key: str, prefix: str, slots: asyncio.Semaphore) -> Shard:
        object_key = f"{prefix}/{key}"
        if path.stat().st_size >= self.multipart_threshold_bytes:
            sha256, size_bytes = await self._upload_multipart(s3, path, object_key, slots)
            return Shard(key=key, sha256=sha256, size_bytes=size_bytes)
        async with slots:
            data = await asyncio.to_thread(path.read_bytes)
            # hash while the bytes go out: hashlib releases the GIL, so the two overlap
            sha256, _ = await asyncio.gather(
                asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest()),
                s3.put_object(Bucket=self.bucket, Key=object_key, Body=data),
            )
        return Shard(key=key, sha256=sha256, size_bytes=len(data))

    async def _upload_multipart(self, s3: Any, path: Path, key: str, slots: asyncio.Semaphore) -> tuple[str, int]:
        """Read parts in order (so one sha256 pass sees every byte) while up to `max_concurrency` parts upload."""
        upload_id = (await s3.create_multipart_upload(Bucket=self.bucket, Key=key))["UploadId"]

        async def upload_part(number: int, chunk: bytes) -> dict[str, Any]:
            try:
                response = await s3.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk
                )
                return {"PartNumber": number, "ETag": response["ETag"]}
            finally:
                slots.release()

        digest = hashlib.sha256()
        size_bytes = 0
        uploads: list[asyncio.Future[dict[str, Any]]] = []
        try:
            with path.open("rb") as f:
                while True:
                    await slots.acquire()
                    chunk = await asyncio.to_thread(read_part, f, self.part_bytes, digest)
                    if not chunk:
                        slots.release()
                        break
                    size_bytes += len(chunk)
                    uploads.append(asyncio.ensure_future(upload_part(len(uploads) + 1, chunk)))
            parts = await gather_all(uploads)
            await s3.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            for upload in uploads:
                upload.cancel()
            await asyncio.gather(*uploads, return_exceptions=True)
            with contextlib.suppress(ClientError):  # best effort: the error worth raising is the one above
                await asyncio.shield(s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id))
            raise
        return digest.hexdigest(), size_bytes

    async def _download(self, s3: Any, key: str, dst: Path, shard: Shard, what: str, slots: asyncio.Semaphore) -> None:
        """Stream one object to `dst`, hashing each chunk as it is written; one pass, no read-back."""
        async with slots:
            try:
                response = await s3.get_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if error_code(exc) in MISSING_CODES:
                    raise WeightStoreError(f"{what}: file {shard.key} is missing") from None
                raise
            dst.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            size_bytes = 0
            body = response["Body"]  # entering it yields the raw aiohttp response; read through the wrapper
            with dst.open("wb") as f:
                async with body:
                    while chunk := await body.read(CHUNK_BYTES):
                        digest.update(chunk)
                        f.write(chunk)
                        size_bytes += len(chunk)
        check_shard(shard, size_bytes, digest.hexdigest(), what)

    async def _download_verified(
        self, s3: Any, prefix: str, shards: list[Shard], manifest_bytes: bytes, final: Path, what: str
    ) -> Path:
        """`final` holding every shard verified: a cached copy is re-verified, never trusted; else download it."""
        if final.is_dir():
            try:
                await asyncio.to_thread(verify_files, final, shards, what)
                return final
            except WeightStoreError as exc:
                log.warning("cached copy %s is bad, downloading again: %s", final, exc)
                shutil.rmtree(final, ignore_errors=True)
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")
        tmp.mkdir(parents=True)
        try:
            slots = asyncio.Semaphore(self.max_concurrency)
            await gather_all(self._download(s3, self._key(f"{prefix}/{s.key}"), tmp / s.key, s, what, slots)
                             for s in shards)
            (tmp / MANIFEST).write_bytes(manifest_bytes)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not final.is_dir():
                raise
            # another process sharing the cache renamed its verified copy into place first
        return final

    def _prune_cache(self, fetched: Path, name_prefix: str, num_kept: int) -> None:
        """Keep `fetched` and the newest `num_kept` cached dirs; a reader still loading another one sees it vanish
        and refuses it, keeping what it serves."""
        parent = fetched.parent
        numbered = sorted((n, p) for p in parent.iterdir() if (n := parse_number(p.name, name_prefix)) is not None)
        for _, path in numbered[:-num_kept]:
            if path != fetched:
                shutil.rmtree(path, ignore_errors=True)

    # --- the store's primitives ---

    async def _read(self, s3: Any, key: str) -> bytes | None:
        found = await self._get_bytes(s3, self._key(key))
        return found[0] if found else None

    async def _put_tree(self, s3: Any, src_dir: Path, prefix: str) -> list[Shard]:
        return await self._upload_tree(s3, src_dir, self._key(prefix))  # a dead writer's objects are overwritten

    async def _put_create_only(self, s3: Any, key: str, data: bytes) -> bool:
        """Put `key` only if absent (`IfNoneMatch`); a retried put of ours, finding its own bytes, counts as won."""
        try:
            await s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if error_code(exc) not in CONFLICT_CODES:
                raise
        return await self._read(s3, key) == data

    async def _read_latest(self, s3: Any) -> tuple[int | None, Any]:
        """LATEST and its ETag, or (None, None) before the first publish."""
        found = await self._get_bytes(s3, self._key(f"weights/{LATEST}"))
        return (int(found[0].decode().strip()), found[1]) if found else (None, None)

    async def _swap_latest(self, s3: Any, etag: Any, new: int) -> bool:
        """Set LATEST only if its ETag is still `etag` (`IfMatch`; None: only if LATEST does not exist)."""
        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            await s3.put_object(Bucket=self.bucket, Key=self._key(f"weights/{LATEST}"), Body=f"{new}\n".encode(),
                                **condition)
            return True
        except ClientError as exc:
            if error_code(exc) in CONFLICT_CODES:
                return False
            raise

    async def _numbered(self, s3: Any, prefix: str, name_prefix: str) -> list[int]:
        numbers = []
        for key in await self._keys(s3, self._key(f"{prefix}/{name_prefix}")):
            parts = key.removeprefix(self._key(f"{prefix}/")).split("/")
            if len(parts) == 2 and parts[1] == MANIFEST and (n := parse_number(parts[0], name_prefix)) is not None:
                numbers.append(n)
        return sorted(numbers)

    async def _delete(self, s3: Any, prefix: str) -> None:
        await s3.delete_object(Bucket=self.bucket, Key=self._key(f"{prefix}/{MANIFEST}"))
        keys = await self._keys(s3, self._key(f"{prefix}/"))
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            await s3.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})

    async def _materialize(self, s3: Any, prefix: str, shards: list[Shard], manifest: bytes, what: str) -> Path:
        """A verified copy in the local cache; the cache keeps the newest few versions and one checkpoint."""
        final = self.cache_dir / prefix
        path = await self._download_verified(s3, prefix, shards, manifest, final, what)
        name_prefix, num_kept = ("v", self.num_cached_versions) if prefix.startswith("weights/") else ("step", 1)
        self._prune_cache(final, name_prefix, num_kept)
        return path
