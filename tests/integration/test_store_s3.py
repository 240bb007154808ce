"""S3WeightStore's own details against a real S3 server (moto's ThreadedMotoServer on 127.0.0.1): its layout,
multipart uploads, conditional-write races, the cache, the rollout worker's refusal and polling, and a trainer
resumed from S3. The contract both backends keep is test_store_contract.py."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
import redis
import torch
from job_harness import audit_ledger, launch, service_logs, stop
from safetensors.torch import save_file

from jetroll.bench.tcp_proxy import TcpProxy
from jetroll.services.rollout.worker import RolloutWorker
from jetroll.shared.config.job import load_config
from jetroll.shared.numerics import MASTERS, QuantizationPlan
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.store.base import WeightStoreError
from jetroll.shared.store.s3 import S3WeightStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
PREFIX = "runs"
JOB = "job1"
MIB = 1 << 20


@pytest.fixture
def s3(s3_url: str) -> Any:
    return boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")


@pytest.fixture
def bucket(s3: Any) -> str:
    """A fresh bucket per test: moto's state lives in this process and outlives a test."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def make_store(s3_url: str, bucket: str, cache: Path, job: str = JOB, **kwargs: Any) -> S3WeightStore:
    return S3WeightStore(bucket, PREFIX, job, cache, endpoint_url=s3_url, region="us-east-1", **kwargs)


def model_dir(path: Path, seed: int = 0, shard_bytes: int = 3000) -> Path:
    """A fake HF-format model dir: a safetensors shard, config and tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    save_file({"w": torch.rand(shard_bytes // 4, generator=generator)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"seed": seed}))
    (path / "tokenizer.json").write_text("{}")
    return path


# the plan of `model_dir`'s one tensor, which a rollout worker checks each version it loads against
PLAN = QuantizationPlan(source=MASTERS, scale_format="fp32", activation_group=128, params={"w": "fp32"})


def publish(store: S3WeightStore, version: int, src: Path, **kwargs: Any) -> Any:
    args: dict[str, Any] = {"precision_id": "abc123", "dtype": "float32", "parent": version - 1 if version else None,
                            "quantization_plan": PLAN}
    args.update(kwargs)
    return store.publish(version, version * 10, src, **args)


def keys(s3: Any, bucket: str, prefix: str = "") -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def corrupt(s3: Any, bucket: str, key: str) -> None:
    """Flip one byte of an object, keeping its size, as bit rot or a bad copy would."""
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def test_publish_then_fetch_verifies(s3_url: str, s3: Any, bucket: str, tmp_path: Path) -> None:
    # a 12 MiB shard over a 5 MiB threshold goes up as a 3-part multipart upload
    store = make_store(s3_url, bucket, tmp_path / "cache", multipart_threshold_bytes=5 * MIB, part_bytes=5 * MIB)
    src = model_dir(tmp_path / "src", shard_bytes=12 * MIB)
    manifest = asyncio.run(publish(store, 0, src, is_checkpoint=True))

    assert (manifest.version, manifest.step, manifest.parent, manifest.is_checkpoint) == (0, 0, None, True)
    for shard in manifest.shards:
        data = (src / shard.key).read_bytes()
        assert shard.sha256 == hashlib.sha256(data).hexdigest() and shard.size_bytes == len(data)
    vkey = f"{PREFIX}/{JOB}/weights/v00000000"
    assert keys(s3, bucket) == sorted(
        [
            f"{vkey}/config.json",
            f"{vkey}/manifest.json",
            f"{vkey}/model.safetensors",
            f"{vkey}/tokenizer.json",
            f"{PREFIX}/{JOB}/weights/LATEST",
        ]
    )
    assert s3.head_object(Bucket=bucket, Key=f"{vkey}/model.safetensors")["ETag"].endswith('-3"')
    assert s3.get_object(Bucket=bucket, Key=f"{PREFIX}/{JOB}/weights/LATEST")["Body"].read() == b"0\n"
    assert store.uri(0) == f"s3://{bucket}/{vkey}/manifest.json"

    async def read_back() -> Path:
        assert await store.latest() == 0 and await store.versions() == [0]
        assert await store.manifest(0) == manifest
        return await store.fetch(0)

    fetched = asyncio.run(read_back())
    assert fetched == tmp_path / "cache" / JOB / "s3-cache" / "weights" / "v00000000"
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (fetched / name).read_bytes() == (src / name).read_bytes()

    # a cached copy is re-verified, not trusted: a damaged one is downloaded again
    (fetched / "config.json").write_text("tampered")
    assert json.loads((asyncio.run(store.fetch(0)) / "config.json").read_text()) == {"seed": 0}
    assert asyncio.run(publish(store, 0, src)).shards == asyncio.run(store.manifest(0)).shards  # a retry: it wins
    with pytest.raises(WeightStoreError, match="version 5 is not published"):
        asyncio.run(store.fetch(5))


def test_concurrent_publishers_exactly_one_wins_latest(s3_url: str, bucket: str, tmp_path: Path) -> None:
    """Each publisher has its own store and client, as separate trainer processes would."""
    stores = [make_store(s3_url, bucket, tmp_path / f"cache{i}") for i in range(3)]
    src = model_dir(tmp_path / "src")
    asyncio.run(publish(stores[0], 0, src))

    async def race_cas(new_versions: tuple[int, int]) -> list[bool]:
        """Two compare-and-swaps of LATEST from the same ETag."""
        async with stores[0].client() as c0:
            _, etag = await stores[0]._read_latest(c0)
        async with stores[1].client() as c1, stores[2].client() as c2:
            return list(
                await asyncio.gather(
                    stores[1]._swap_latest(c1, etag, new_versions[0]), stores[2]._swap_latest(c2, etag, new_versions[1])
                )
            )

    for round_ in range(10):
        won = asyncio.run(race_cas((2 * round_ + 1, 2 * round_ + 2)))
        assert sorted(won) == [False, True], won

    # The same version from two publishers: the create-only manifest lets exactly one through, and LATEST is its.
    fresh = [make_store(s3_url, bucket, tmp_path / f"fresh{i}", job="job2") for i in range(2)]

    async def race_publish() -> list[Any]:
        return await asyncio.gather(
            *(publish(s, 1, src, precision_id=f"p{i}") for i, s in enumerate(fresh)), return_exceptions=True
        )

    results = asyncio.run(race_publish())
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], WeightStoreError) and "published" in str(losers[0])
    assert asyncio.run(fresh[0].latest()) == 1
    assert asyncio.run(fresh[1].manifest(1)) == winners[0]
    asyncio.run(fresh[1].fetch(1))

    # Different versions at once: every manifest lands and LATEST ends at the highest, never lower.
    later = [make_store(s3_url, bucket, tmp_path / f"later{i}", job="job3") for i in range(8)]

    async def race_versions() -> None:
        await asyncio.gather(*(publish(s, v, src) for v, s in enumerate(later)))

    asyncio.run(race_versions())
    assert asyncio.run(later[0].latest()) == 7
    assert asyncio.run(later[0].versions()) == list(range(8))


def test_corrupt_shard_refused_and_worker_keeps_old_version(
    s3_url: str, s3: Any, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(s3_url, bucket, tmp_path / "cache")
    asyncio.run(publish(store, 1, model_dir(tmp_path / "v1", seed=1)))
    asyncio.run(publish(store, 2, model_dir(tmp_path / "v2", seed=2)))
    corrupt(s3, bucket, f"{PREFIX}/{JOB}/weights/v00000002/model.safetensors")

    with pytest.raises(WeightStoreError, match="model.safetensors fails its sha256 check"):
        asyncio.run(store.fetch(2))
    weights_cache = store.cache_dir / "weights"
    assert [p.name for p in weights_cache.iterdir()] == []  # nothing half-downloaded is left, nothing renamed in

    config = load_config(SMOKE)
    worker = RolloutWorker(config, config.build_tasks(), bus=None, store=store,  # type: ignore[arg-type]
                           consumer="rollout-0")
    worker.engine, worker.plan = SimpleNamespace(version=1), PLAN  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="jetroll.rollout"):
        asyncio.run(worker._load(2))
    assert worker.pending_weights is None and worker._current_version() == 1
    assert "refusing weights v2, keeping v1" in caplog.text

    asyncio.run(publish(store, 3, model_dir(tmp_path / "v3", seed=3)))
    asyncio.run(worker._load(3))  # the next good version goes through
    assert worker.pending_weights is not None and worker.pending_weights[0] == 3


def test_worker_polls_latest_without_a_weights_event(s3_url: str, bucket: str, tmp_path: Path, redis_url: str) -> None:
    store = make_store(s3_url, bucket, tmp_path / "cache")
    asyncio.run(publish(store, 1, model_dir(tmp_path / "v1", seed=1)))
    config = load_config(SMOKE, [f"job_id=poll{uuid.uuid4().hex[:6]}", "store.poll_interval_s=0.2"])

    async def main() -> int | None:
        bus = RedisBus(redis_url, config.job_id)
        worker = RolloutWorker(config, config.build_tasks(), bus, store, "rollout-0")
        worker.engine, worker.plan = SimpleNamespace(version=1), PLAN  # type: ignore[assignment]
        watcher = asyncio.create_task(worker._watch_weights())
        try:
            await publish(store, 2, model_dir(tmp_path / "v2", seed=2))  # no XADD to the weights stream
            for _ in range(100):
                if worker.pending_weights is not None:
                    return worker.pending_weights[0]
                await asyncio.sleep(0.1)
            return None
        finally:
            watcher.cancel()
            await bus.close()

    assert asyncio.run(main()) == 2


def test_partial_upload_is_never_visible(
    s3_url: str, s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(s3_url, bucket, tmp_path / "cache", multipart_threshold_bytes=5 * MIB, part_bytes=5 * MIB)
    asyncio.run(publish(store, 0, model_dir(tmp_path / "v0")))
    src = model_dir(tmp_path / "v1", seed=1, shard_bytes=12 * MIB)

    # Crash after the shards, before the manifest.
    async def crash(*args: object) -> bool:
        raise RuntimeError("trainer died")

    with monkeypatch.context() as patch:
        patch.setattr(S3WeightStore, "_put_create_only", crash)
        with pytest.raises(RuntimeError, match="trainer died"):
            asyncio.run(publish(store, 1, src))
    vkey = f"{PREFIX}/{JOB}/weights/v00000001"
    assert f"{vkey}/model.safetensors" in keys(s3, bucket, vkey)  # the shards are there ...
    assert asyncio.run(store.versions()) == [0] and asyncio.run(store.latest()) == 0  # ... but no version is
    with pytest.raises(WeightStoreError, match="version 1 is not published"):
        asyncio.run(store.fetch(1))

    # Crash in the middle of a multipart upload: the upload is aborted, no parts are left behind.
    import jetroll.shared.store.s3 as store_module

    real_read_part = store_module.read_part
    calls = []

    def failing_read_part(*args: Any) -> bytes:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk went away")
        return real_read_part(*args)

    with monkeypatch.context() as patch:
        patch.setattr(store_module, "read_part", failing_read_part)
        with pytest.raises(OSError, match="disk went away"):
            asyncio.run(publish(store, 1, src))
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert asyncio.run(store.versions()) == [0] and asyncio.run(store.latest()) == 0

    # The retried publish overwrites the leftovers and verifies.
    asyncio.run(publish(store, 1, src))
    assert asyncio.run(store.latest()) == 1
    assert (asyncio.run(store.fetch(1)) / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()




@pytest.mark.slow
def test_trainer_resumes_from_s3_checkpoint(
    s3_url: str, s3: Any, bucket: str, tmp_path: Path, redis_url: str, model_path: str
) -> None:
    """A 4-step job on S3, then the same job id asked for 6 steps from a fresh run dir: only S3 holds its state."""
    job_id = f"s{uuid.uuid4().hex[:8]}"
    store_args = (f"store.uri=s3://{bucket}/{PREFIX}", f"store.endpoint_url={s3_url}", "trainer.checkpoint_every=2")
    first = launch(
        tmp_path, redis_url, model_path, *store_args, "trainer.max_steps=4", job_id=job_id, run_dir=tmp_path / "run1"
    )
    try:
        assert first.wait() == 0, f"{first.stderr()}\n{service_logs(first.run_dir)}"
    finally:
        stop(first)
    second = launch(
        tmp_path, redis_url, model_path, *store_args, "trainer.max_steps=6", job_id=job_id, run_dir=tmp_path / "run2"
    )
    try:
        assert second.wait() == 0, f"{second.stderr()}\n{service_logs(second.run_dir)}"
    finally:
        stop(second)

    assert "resumed from checkpoint step 4 at version 4" in second.service_log("trainer")
    summary = json.loads((second.run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["dead_letters"] == {}  # every announcement named its manifest in this job's S3 store
    root = f"{PREFIX}/{job_id}"
    assert s3.get_object(Bucket=bucket, Key=f"{root}/weights/LATEST")["Body"].read() == b"6\n"
    checkpoints = {k.split("/")[3] for k in keys(s3, bucket, f"{root}/checkpoints/") if k.endswith("manifest.json")}
    # every 2nd state kept as a milestone, and the newest store.keep_checkpoints (2) of the per-step ones
    assert checkpoints == {"step00000000", "step00000002", "step00000004", "step00000005", "step00000006"}
    for run_dir in (first.run_dir, second.run_dir):  # nothing was published locally: the local dir is only a cache
        assert [p.name for p in (run_dir / "store" / job_id).iterdir()] == ["s3-cache"]
    client = redis.Redis.from_url(redis_url)
    try:
        ledger = [json.loads(v) for v in client.hgetall(f"jetroll:{job_id}:ledger").values()]
    finally:
        client.close()
    assert sorted(o["step"] for o in ledger if o["status"] == "trained") == sorted(list(range(1, 7)) * 4)


OUTAGE_S = 30.0


@pytest.mark.slow
def test_a_job_rides_out_a_30_s_s3_outage(
    s3_url: str, s3: Any, bucket: str, tmp_path: Path, redis_url: str, model_path: str
) -> None:
    """S3 unreachable for 30 s mid-job (a cut proxy in front of moto): the trainer's requests wait and retry, no
    service dies, and the job ends with every step trained once and LATEST at its last version."""
    target = urlsplit(s3_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 80).start()
    max_steps = 8
    job = launch(tmp_path, redis_url, model_path, f"store.uri=s3://{bucket}/{PREFIX}",
                 f"store.endpoint_url={proxy.url}", f"trainer.max_steps={max_steps}")
    try:
        job.wait_until(lambda: len(job.metrics()) >= 3, "3 steps")
        proxy.cut()
        time.sleep(OUTAGE_S)
        proxy.restore()
        assert job.wait() == 0, job.report()
    finally:
        stop(job)
        proxy.cut()
    assert " died " not in job.stderr(), job.stderr()
    assert json.loads((job.run_dir / "summary.json").read_text())["steps"] == max_steps
    assert [row["step"] for row in job.metrics()] == list(range(1, max_steps + 1))
    totals = audit_ledger(redis_url, job.job_id, max_steps, groups_per_step=4, group_size=4)
    assert totals.num_dropped == 0, totals
    # training really stopped on the store: some step's commit waited out most of the outage
    times = [row["time_s"] for row in job.metrics()]
    assert max(b - a for a, b in itertools.pairwise(times)) > OUTAGE_S * 0.8, times
    latest = s3.get_object(Bucket=bucket, Key=f"{PREFIX}/{job.job_id}/weights/LATEST")["Body"].read()
    assert latest == f"{max_steps}\n".encode()
