"""LocalWeightStore: manifests with sha256, create-only publish, forward-only LATEST, retention, checkpoints."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest

from jetroll.shared.config.base import ConfigError
from jetroll.shared.config.job import load_config, validate_config
from jetroll.shared.config.store import StoreConfig
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


def test_publish_fetch_round_trip(tmp_path: Path) -> None:
    src = model_dir(tmp_path / "src")
    store = LocalWeightStore(tmp_path / "store", "job1")
    manifest = publish(store, 0, src)

    assert manifest.version == 0 and manifest.step == 0 and manifest.parent is None
    assert manifest.precision_id == "abc123" and manifest.dtype == "float8_e4m3fn" and not manifest.is_checkpoint
    names = sorted(p.name for p in src.iterdir())
    assert [s.key for s in manifest.shards] == names
    for shard in manifest.shards:
        data = (src / shard.key).read_bytes()
        assert shard.sha256 == hashlib.sha256(data).hexdigest() and shard.size_bytes == len(data)

    vdir = tmp_path / "store" / "job1" / "weights" / "v00000000"
    assert (vdir / "manifest.json").is_file()
    assert asyncio.run(store.manifest(0)) == manifest
    assert store.uri(0) == (vdir / "manifest.json").resolve().as_uri()
    assert store.uri(0).startswith("file:///")

    fetched = asyncio.run(store.fetch(0))
    for name in names:
        assert (fetched / name).read_bytes() == (src / name).read_bytes()
    assert asyncio.run(store.latest()) == 0
    assert asyncio.run(store.versions()) == [0]

    with pytest.raises(WeightStoreError, match="version 5 is not published"):
        asyncio.run(store.fetch(5))


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


def test_manifest_is_create_only(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    first = publish(store, 1, model_dir(tmp_path / "a", seed=1))
    with pytest.raises(WeightStoreError, match="version 1 is already published"):
        publish(store, 1, model_dir(tmp_path / "b", seed=7))
    # The published version is untouched and still verifies.
    assert asyncio.run(store.manifest(1)) == first
    fetched = asyncio.run(store.fetch(1))
    assert json.loads((fetched / "config.json").read_text()) == {"seed": 1}


def test_crashed_publish_leftovers_are_not_a_version(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    leftover = store.version_dir(2)
    leftover.mkdir(parents=True)
    (leftover / "model-00001-of-00002.safetensors").write_bytes(b"half")
    (leftover / "stale.bin").write_bytes(b"x")
    assert asyncio.run(store.versions()) == []
    manifest = publish(store, 2, model_dir(tmp_path / "src"))
    assert not (leftover / "stale.bin").exists()
    assert "stale.bin" not in {s.key for s in manifest.shards}
    asyncio.run(store.fetch(2))


def test_latest_only_moves_forward(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    src = model_dir(tmp_path / "src")
    assert asyncio.run(store.latest()) is None
    publish(store, 3, src)
    assert asyncio.run(store.latest()) == 3
    publish(store, 1, src)  # a late, older publish lands but does not move LATEST back
    assert asyncio.run(store.latest()) == 3
    assert asyncio.run(store.versions()) == [1, 3]
    publish(store, 4, src)
    assert asyncio.run(store.latest()) == 4

    # The CAS refuses a swap whose expected value is stale.
    assert not store._cas_latest(3, 9)
    assert asyncio.run(store.latest()) == 4
    assert store._cas_latest(4, 5)
    assert asyncio.run(store.latest()) == 5


def test_concurrent_publishes_leave_latest_at_the_max(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    src = model_dir(tmp_path / "src")

    async def main() -> None:
        await asyncio.gather(*(store.publish(v, v, src, precision_id="p", dtype="bf16", parent=None) for v in range(8)))

    asyncio.run(main())
    assert asyncio.run(store.latest()) == 7
    assert asyncio.run(store.versions()) == list(range(8))


def test_retention_keeps_last_k_checkpoints_and_latest(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    src = model_dir(tmp_path / "src")
    for version in range(8):
        publish(store, version, src, is_checkpoint=version in (1, 4))
    deleted = asyncio.run(store.retain(keep_last=2))
    assert deleted == [0, 2, 3, 5]
    assert asyncio.run(store.versions()) == [1, 4, 6, 7]
    assert not store.version_dir(0).exists()
    for version in (1, 4, 6, 7):
        asyncio.run(store.fetch(version))
    assert asyncio.run(store.retain(keep_last=2)) == []

    # LATEST is kept even outside the last K: here a publish of 6 crashed after its manifest, before the CAS.
    store2 = LocalWeightStore(tmp_path / "store2", "job1")
    for version in (0, 5, 6):
        publish(store2, version, src)
    (store2.weights_dir / "LATEST").write_text("5\n")
    assert asyncio.run(store2.retain(keep_last=1)) == [0]
    assert asyncio.run(store2.versions()) == [5, 6]

    with pytest.raises(ValueError, match="keep_last"):
        asyncio.run(store.retain(0))


def test_checkpoint_save_and_latest(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    assert asyncio.run(store.latest_checkpoint()) is None
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "master.safetensors").write_bytes(b"\x01" * 5000)
    (ckpt / "optimizer.safetensors").write_bytes(b"\x02" * 700)
    (ckpt / "state.json").write_text(json.dumps({"step": 20, "rng": [1, 2]}))

    asyncio.run(store.save_checkpoint(20, ckpt))
    (ckpt / "state.json").write_text(json.dumps({"step": 40}))
    asyncio.run(store.save_checkpoint(40, ckpt))

    step, path = asyncio.run(store.latest_checkpoint())
    assert step == 40 and path == store.checkpoints_dir / "step00000040"
    assert json.loads((path / "state.json").read_text()) == {"step": 40}
    assert (path / "manifest.json").is_file()
    assert not [p for p in store.checkpoints_dir.iterdir() if p.name.startswith(".")]  # no temp dirs left

    with pytest.raises(WeightStoreError, match="step 40 already exists"):
        asyncio.run(store.save_checkpoint(40, ckpt))

    # A corrupted newest checkpoint is not trusted: resume falls back to the last one that verifies.
    (path / "master.safetensors").write_bytes(b"\x00" * 5000)
    assert asyncio.run(store.latest_checkpoint()) == (20, store.checkpoints_dir / "step00000020")
    # A half-written temp dir from a crash is ignored.
    (store.checkpoints_dir / ".step00000060.tmp-dead").mkdir()
    assert asyncio.run(store.latest_checkpoint())[0] == 20


def test_failed_checkpoint_leaves_nothing(tmp_path: Path) -> None:
    store = LocalWeightStore(tmp_path / "store", "job1")
    with pytest.raises(WeightStoreError, match="does not exist"):
        asyncio.run(store.save_checkpoint(1, tmp_path / "missing"))
    assert list(store.checkpoints_dir.iterdir()) == []
    assert asyncio.run(store.latest_checkpoint()) is None


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
