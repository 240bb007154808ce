"""LocalWeightStore's own details (its layout, file URIs, the LATEST lock, temp dirs) and setup_store; the store
contract both backends keep is tests/integration/test_store_contract.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from jetroll.shared.config.job import load_config, validate_config
from jetroll.shared.config.store import StoreConfig
from jetroll.shared.errors import ConfigError
from jetroll.shared.store import setup_store
from jetroll.shared.store.base import WeightStoreError
from jetroll.shared.store.local import LocalWeightStore
from jetroll.shared.store.s3 import S3WeightStore


def model_dir(path: Path, seed: int = 0) -> Path:
    """A fake HF-format model dir: two shards, config and tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "model-00001-of-00002.safetensors").write_bytes(bytes([seed]) * 3000 + b"a")
    (path / "model-00002-of-00002.safetensors").write_bytes(bytes([seed + 1]) * (1 << 20) + b"b")  # > one chunk
    (path / "config.json").write_text(json.dumps({"seed": seed}))
    (path / "tokenizer.json").write_text("{}")
    return path


def publish(store: LocalWeightStore, version: int, src: Path, **kwargs: object) -> object:
    args = {"precision_id": "abc123", "dtype": "float8_e4m3fn", "parent": version - 1 if version else None}
    args.update(kwargs)
    return asyncio.run(store.publish(version, version * 10, src, **args))


def test_the_local_layout_and_its_file_uris(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    publish(store, 0, model_dir(tmp_path / "src"))
    vdir = tmp_path / "store" / "job1" / "weights" / "v00000000"
    assert (vdir / "manifest.json").is_file() and asyncio.run(store.fetch(0)) == vdir.resolve()
    assert store.uri(0) == (vdir / "manifest.json").resolve().as_uri() and store.uri(0).startswith("file:///")


def test_corrupted_or_missing_shard_is_refused(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    publish(store, 0, model_dir(tmp_path / "src"))
    vdir = store.version_dir(0)
    shard = vdir / "model-00002-of-00002.safetensors"

    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightStoreError, match="model-00002-of-00002.safetensors fails its sha256"):
        asyncio.run(store.fetch(0))

    shard.write_bytes(b"short")
    with pytest.raises(WeightStoreError, match="model-00002-of-00002.safetensors has 5 bytes"):
        asyncio.run(store.fetch(0))

    (vdir / "config.json").unlink()
    with pytest.raises(WeightStoreError, match="config.json is missing"):
        asyncio.run(store.fetch(0))




def test_a_staged_publish_keeps_its_files_by_link_and_any_other_is_copied(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    (store.staging_dir / "dead-writer").mkdir(parents=True)  # what a trainer that died left staged

    async def publish_staged() -> tuple[Path, dict[str, int]]:
        async with store.staging() as staging:
            assert staging.parent == store.staging_dir and not (store.staging_dir / "dead-writer").exists()
            src = model_dir(staging / "weights")
            inodes = {p.name: p.stat().st_ino for p in src.iterdir()}
            await store.publish(0, 0, src, precision_id="abc123", dtype="float32", parent=None)
            return staging, inodes

    staging, inodes = asyncio.run(publish_staged())
    assert not staging.exists()
    stored = asyncio.run(store.fetch(0))  # verified: the manifest hashed the linked files
    assert {name: (stored / name).stat().st_ino for name in inodes} == inodes
    src = model_dir(tmp_path / "src", seed=1)
    publish(store, 1, src)
    assert all((store.version_dir(1) / p.name).stat().st_ino != p.stat().st_ino for p in src.iterdir())
    assert (store.version_dir(1) / "config.json").read_text() == (src / "config.json").read_text()


def test_the_latest_swap_refuses_a_stale_expectation(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    publish(store, 4, model_dir(tmp_path / "src"))
    assert not store._cas_latest(3, 9)
    assert asyncio.run(store.latest()) == 4
    assert store._cas_latest(4, 5)
    assert asyncio.run(store.latest()) == 5




def test_checkpoints_leave_no_temp_dirs_and_ignore_a_crashed_one(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": 20}))
    asyncio.run(store.save_checkpoint(20, ckpt))
    assert [p.name for p in store.checkpoints_dir.iterdir()] == ["step00000020"]
    (store.checkpoints_dir / ".step00000060.tmp-dead").mkdir()
    assert asyncio.run(store.latest_checkpoint()) == (20, store.checkpoints_dir / "step00000020")


def test_setup_store(tmp_path: Path) -> None:
    store = setup_store(StoreConfig(), "jobA", tmp_path / "run")
    assert isinstance(store, LocalWeightStore)
    assert store.weights_dir == (tmp_path / "run" / "store" / "jobA" / "weights").resolve()
    store = setup_store(StoreConfig(root=str(tmp_path / "elsewhere")), "jobA", tmp_path / "run")
    assert store.root == (tmp_path / "elsewhere").resolve()
    store = setup_store(StoreConfig(uri="s3://bkt/a/b/", endpoint_url="http://127.0.0.1:9"), "jobA", tmp_path / "run")
    assert isinstance(store, S3WeightStore)
    assert (store.bucket, store.weights_prefix, store.endpoint_url) == ("bkt", "a/b/jobA/weights", "http://127.0.0.1:9")
    assert store.uri(3) == "s3://bkt/a/b/jobA/weights/v00000003/manifest.json"
    assert store.cache_dir == (tmp_path / "run" / "store" / "jobA" / "s3-cache").resolve()
    with pytest.raises(ValueError, match=r"unknown store type 'gcs'; valid: \['local', 's3'\]"):
        setup_store(StoreConfig.model_construct(type="gcs", root="", keep_last=3), "jobA", tmp_path)


def test_store_config_uri() -> None:
    config = load_config(None, ["store.uri=s3://my-bucket/runs/a/", "store.endpoint_url=http://127.0.0.1:9000"])
    assert config.store.type == "s3" and config.store.bucket_and_prefix == ("my-bucket", "runs/a")
    assert validate_config(config.model_dump()).store == config.store  # the launcher's round trip
    assert load_config(None).store.type == "local"
    for bad in ("http://bucket/x", "s3://Bad_Bucket/x", "s3://", "s3:/bucket"):
        with pytest.raises(ConfigError, match="store.uri must look like s3://bucket/prefix") as err:
            load_config(None, [f"store.uri={bad}"])
        assert len(str(err.value).splitlines()) == 1
    with pytest.raises(ConfigError, match="store.uri must look like s3://bucket/prefix .*got ''"):
        load_config(None, ["store.type=s3"])
    with pytest.raises(ConfigError, match="store.type 'local' conflicts with store.uri"):
        load_config(None, ["store.type=local", "store.uri=s3://bucket/x"])


class _CutBody:
    """An S3 response body whose connection is lost mid-read `cuts` times, then reads whole."""

    def __init__(self, data: bytes, cuts: list[int]) -> None:
        self.data, self.cuts = data, cuts

    async def __aenter__(self) -> _CutBody:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        from aiohttp import ClientPayloadError

        if self.cuts[0] > 0:
            self.cuts[0] -= 1
            raise ClientPayloadError("Response payload is not completed")
        return self.data


class _CutS3:
    def __init__(self, cuts: int) -> None:
        self.cuts, self.gets = [cuts], 0

    async def get_object(self, Bucket: str, Key: str) -> dict:  # noqa: N803 (boto's names)
        self.gets += 1
        return {"Body": _CutBody(b"7\n", self.cuts), "ETag": '"e"'}


def test_an_s3_body_cut_off_mid_read_is_read_again_and_one_that_stays_cut_is_a_store_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore retries requests, not the reading of their bodies (a proxy cut there killed a trainer once)."""
    pytest.importorskip("aiohttp")
    from jetroll.shared.store.s3 import S3WeightStore

    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    store = S3WeightStore("bucket", "prefix", "job", tmp_path, max_attempts=3)
    twice_cut = _CutS3(cuts=2)
    assert asyncio.run(store._get_bytes(twice_cut, "weights/LATEST")) == (b"7\n", '"e"')
    assert twice_cut.gets == 3
    with pytest.raises(WeightStoreError, match="reading s3://bucket/weights/LATEST failed 3 times"):
        asyncio.run(store._get_bytes(_CutS3(cuts=3), "weights/LATEST"))


async def _no_sleep(seconds: float) -> None:
    return None
