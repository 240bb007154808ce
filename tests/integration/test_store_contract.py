"""The weight store's contract, run against both backends: the local directory and S3 (a moto server on
127.0.0.1). Each backend's own details (S3's multipart and conditional-write races, the local lock) are tested in
test_store.py and test_store_s3.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from jetroll.shared.store.base import Manifest, WeightStore, WeightStoreError
from jetroll.shared.store.local import LocalWeightStore
from jetroll.shared.store.s3 import S3WeightStore

pytestmark = pytest.mark.integration


@dataclass
class Backend:
    """One backend's stores, and raw access to what they wrote (keys relative to the job's root)."""

    name: str
    tmp: Path
    s3: Any = None
    s3_url: str = ""
    bucket: str = ""

    def store(self, job: str = "job1") -> WeightStore:
        if self.name == "local":
            return LocalWeightStore(self.tmp / "store", job)
        return S3WeightStore(self.bucket, "runs", job, self.tmp / f"cache-{job}", endpoint_url=self.s3_url,
                             region="us-east-1")

    def read(self, key: str, job: str = "job1") -> bytes:
        if self.name == "local":
            return (self.tmp / "store" / job / key).read_bytes()
        return self.s3.get_object(Bucket=self.bucket, Key=f"runs/{job}/{key}")["Body"].read()

    def write(self, key: str, data: bytes, job: str = "job1") -> None:
        if self.name == "local":
            path = self.tmp / "store" / job / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        else:
            self.s3.put_object(Bucket=self.bucket, Key=f"runs/{job}/{key}", Body=data)

    def corrupt(self, key: str, job: str = "job1") -> None:
        """Flip one byte, keeping the size, as bit rot or a bad copy would."""
        data = bytearray(self.read(key, job))
        data[len(data) // 2] ^= 0xFF
        self.write(key, bytes(data), job)


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "local":
        yield Backend("local", tmp_path)
        return
    s3_url = request.getfixturevalue("s3_url")
    s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
    bucket = f"t-{uuid.uuid4().hex[:12]}"  # moto's state outlives a test
    s3.create_bucket(Bucket=bucket)
    yield Backend("s3", tmp_path, s3, s3_url, bucket)


def model_dir(path: Path, seed: int = 0) -> Path:
    """A fake HF-format model dir: two shards (one over a read chunk), config and tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "model-00001-of-00002.safetensors").write_bytes(bytes([seed]) * 3000 + b"a")
    (path / "model-00002-of-00002.safetensors").write_bytes(bytes([seed + 1]) * (1 << 20) + b"b")
    (path / "config.json").write_text(json.dumps({"seed": seed}))
    (path / "tokenizer.json").write_text("{}")
    return path


def publish(store: WeightStore, version: int, src: Path, **kwargs: Any) -> Manifest:
    args: dict[str, Any] = {"precision_id": "abc123", "dtype": "float32", "parent": version - 1 if version else None}
    return asyncio.run(store.publish(version, version * 10, src, **(args | kwargs)))


def test_a_published_version_fetches_back_verified(backend: Backend, tmp_path: Path) -> None:
    store, src = backend.store(), model_dir(tmp_path / "src")
    assert asyncio.run(store.latest()) is None and asyncio.run(store.versions()) == []
    manifest = publish(store, 0, src)
    assert (manifest.version, manifest.step, manifest.parent, manifest.is_checkpoint) == (0, 0, None, False)
    assert sorted(s.key for s in manifest.shards) == sorted(p.name for p in src.iterdir())
    for shard in manifest.shards:
        data = (src / shard.key).read_bytes()
        assert shard.sha256 == hashlib.sha256(data).hexdigest() and shard.size_bytes == len(data)
    assert asyncio.run(store.manifest(0)) == manifest
    assert asyncio.run(store.latest()) == 0 and asyncio.run(store.versions()) == [0]
    fetched = asyncio.run(store.fetch(0))
    assert all((fetched / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())
    with pytest.raises(WeightStoreError, match="version 5 is not published"):
        asyncio.run(store.fetch(5))


def test_a_version_is_published_once(backend: Backend, tmp_path: Path) -> None:
    store = backend.store()
    first = publish(store, 1, model_dir(tmp_path / "a", seed=1))
    with pytest.raises(WeightStoreError, match="version 1 is already published with other weights"):
        publish(store, 1, model_dir(tmp_path / "b", seed=7))
    assert asyncio.run(store.manifest(1)) == first
    # the same files again are a retry of that publish (its first try may have died before LATEST): it finishes
    assert publish(store, 1, tmp_path / "a") == first
    assert json.loads((asyncio.run(store.fetch(1)) / "config.json").read_text()) == {"seed": 1}


def test_a_corrupt_shard_is_refused(backend: Backend, tmp_path: Path) -> None:
    store = backend.store()
    publish(store, 0, model_dir(tmp_path / "src"))
    backend.corrupt("weights/v00000000/model-00002-of-00002.safetensors")
    with pytest.raises(WeightStoreError, match="model-00002-of-00002.safetensors fails its sha256"):
        asyncio.run(store.fetch(0))


def test_a_publish_that_died_before_its_manifest_left_no_version(backend: Backend, tmp_path: Path) -> None:
    store, src = backend.store(), model_dir(tmp_path / "src")
    backend.write("weights/v00000002/model-00001-of-00002.safetensors", b"half")
    assert asyncio.run(store.versions()) == [] and asyncio.run(store.latest()) is None
    with pytest.raises(WeightStoreError, match="version 2 is not published"):
        asyncio.run(store.fetch(2))
    publish(store, 2, src)  # the retried publish replaces the leftovers
    fetched = asyncio.run(store.fetch(2))
    assert (fetched / "model-00001-of-00002.safetensors").read_bytes() == (
        src / "model-00001-of-00002.safetensors").read_bytes()


def test_latest_only_moves_forward(backend: Backend, tmp_path: Path) -> None:
    store, src = backend.store(), model_dir(tmp_path / "src")
    publish(store, 3, src)
    publish(store, 1, src)  # a late, older publish lands but does not move LATEST back
    assert asyncio.run(store.latest()) == 3 and asyncio.run(store.versions()) == [1, 3]
    publish(store, 4, src)
    assert asyncio.run(store.latest()) == 4


def test_concurrent_publishes_leave_latest_at_the_highest(backend: Backend, tmp_path: Path) -> None:
    stores, src = [backend.store() for _ in range(8)], model_dir(tmp_path / "src")

    async def race() -> None:
        await asyncio.gather(*(s.publish(v, v, src, precision_id="p", dtype="bf16", parent=None)
                               for v, s in enumerate(stores)))

    asyncio.run(race())
    assert asyncio.run(stores[0].latest()) == 7 and asyncio.run(stores[0].versions()) == list(range(8))


def test_retention_keeps_the_last_k_the_checkpoints_and_latest(backend: Backend, tmp_path: Path) -> None:
    store, src = backend.store(), model_dir(tmp_path / "src")
    for version in range(8):
        publish(store, version, src, is_checkpoint=version in (1, 4))
    assert asyncio.run(store.retain(keep_last=2)) == [0, 2, 3, 5]
    assert asyncio.run(store.versions()) == [1, 4, 6, 7]
    for version in (1, 4, 6, 7):
        asyncio.run(store.fetch(version))
    assert asyncio.run(store.retain(keep_last=2)) == []
    with pytest.raises(ValueError, match="keep_last"):
        asyncio.run(store.retain(0))
    # LATEST is kept even outside the last K: here a publish of 6 died after its manifest, before its swap
    other = backend.store("job2")
    for version in (0, 5, 6):
        publish(other, version, src)
    backend.write("weights/LATEST", b"5\n", job="job2")
    assert asyncio.run(other.retain(keep_last=1)) == [0] and asyncio.run(other.versions()) == [5, 6]


def test_checkpoints_resume_from_the_newest_that_verifies(backend: Backend, tmp_path: Path) -> None:
    store = backend.store()
    assert asyncio.run(store.latest_checkpoint()) is None
    with pytest.raises(WeightStoreError, match="does not exist"):
        asyncio.run(store.save_checkpoint(1, tmp_path / "missing"))
    assert asyncio.run(store.latest_checkpoint()) is None
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "master.safetensors").write_bytes(b"\x01" * 5000)
    (ckpt / "state.json").write_text(json.dumps({"step": 20}))
    asyncio.run(store.save_checkpoint(20, ckpt))
    (ckpt / "state.json").write_text(json.dumps({"step": 40}))
    asyncio.run(store.save_checkpoint(40, ckpt))
    with pytest.raises(WeightStoreError, match="step 40 already exists"):
        asyncio.run(store.save_checkpoint(40, ckpt))
    backend.write("checkpoints/step00000060/master.safetensors", b"half")  # died before its manifest
    step, path = asyncio.run(store.latest_checkpoint())
    assert step == 40 and json.loads((path / "state.json").read_text()) == {"step": 40}
    backend.corrupt("checkpoints/step00000040/master.safetensors")
    if backend.name == "s3":  # a fresh machine: no verified copy cached
        for cached in path.parent.iterdir():
            for file in cached.iterdir():
                file.unlink()
            cached.rmdir()
    step, path = asyncio.run(store.latest_checkpoint())
    assert step == 20 and json.loads((path / "state.json").read_text()) == {"step": 20}
