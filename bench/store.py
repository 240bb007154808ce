"""Weight-store cost: publish plus load of one version, against the essential work for the same bytes.

The essential work is the floor any store pays for those bytes, one sha256 pass on each side included:
- local: a plain Python write of each file with the store's fsync policy (fsync every file), then a read back;
- s3: one plain PUT of each file from memory, then one plain GET streamed to a local file (the store's cache is
  not fsynced either: a cached copy is re-verified before use), through the same server and client settings.
Cases: the default checkpoint (configs/arithmetic.yaml's tiny model, random init) and a synthetic checkpoint
with one `synthetic_mb` MB safetensors shard. The S3 server is moto, started here as a subprocess so that it runs
on its own core rather than under this process's GIL. Times are medians of `repeats` cold runs (a new version and
an empty cache each time), store and essential interleaved after one warm-up of each.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from jetroll.services.launch.procs import stop_processes
from jetroll.shared.config.job import load_config
from jetroll.shared.config.store import StoreConfig
from jetroll.shared.store.files import CHUNK_BYTES
from jetroll.shared.store.local import LocalWeightStore
from jetroll.shared.store.s3 import S3WeightStore

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "arithmetic.yaml"
BUCKET = "jetroll-bench"
MAX_RATIO = 1.5
SEED = 0


def default_checkpoint(directory: Path) -> Path:
    """The default job's tiny model (configs/arithmetic.yaml), randomly initialised, as an HF-format dir."""
    from jetroll.shared.model.checkpoint import save_pretrained
    from jetroll.shared.model.init import init_weights, model_args
    from jetroll.shared.model.model import CausalLM
    from jetroll.shared.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(SEED)
    model = CausalLM(model_args(load_config(DEFAULT_CONFIG).model, tokenizer))
    init_weights(model)
    save_pretrained(model, tokenizer, directory)
    return directory


def synthetic_checkpoint(directory: Path, template: Path, size_mb: int) -> Path:
    """The default checkpoint's config and tokenizer with one random `size_mb` MB safetensors shard."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    for path in template.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, directory / path.name)
    generator = torch.Generator().manual_seed(SEED)
    weight = torch.randn(size_mb * 1_000_000 // 4, generator=generator)
    save_file({"model.weight": weight}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _files(src: Path) -> dict[str, bytes]:
    return {p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}


def _essential_local(files: dict[str, bytes], dst: Path) -> None:
    dst.mkdir(parents=True)
    for name, data in files.items():
        hashlib.sha256(data).hexdigest()
        with (dst / name).open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    for name in files:
        hashlib.sha256((dst / name).read_bytes()).hexdigest()


async def _essential_s3(s3: Any, files: dict[str, bytes], prefix: str, dst: Path) -> None:
    dst.mkdir(parents=True)
    for name, data in files.items():
        hashlib.sha256(data).hexdigest()
        await s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
    for name in files:
        body = (await s3.get_object(Bucket=BUCKET, Key=f"{prefix}/{name}"))["Body"]
        digest = hashlib.sha256()
        with (dst / name).open("wb") as f:
            async with body:
                while chunk := await body.read(CHUNK_BYTES):
                    digest.update(chunk)
                    f.write(chunk)
        digest.hexdigest()


async def _publish_and_fetch(store: LocalWeightStore | S3WeightStore, src: Path, version: int) -> dict[str, float]:
    started = time.perf_counter()
    await store.publish(version, version, src, precision_id="bench", dtype="float32", parent=None)
    published = time.perf_counter()
    await store.fetch(version)
    done = time.perf_counter()
    return {"store_s": done - started, "publish_s": published - started, "fetch_s": done - published}


async def _empty_bucket(s3: Any) -> None:
    """Untimed cleanup between runs, so the server holds one run's bytes at a time."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    keys = [obj["Key"] async for page in pages for obj in page.get("Contents", [])]
    for start in range(0, len(keys), 1000):
        await s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]]})


def _remove(path: Path) -> None:
    """Untimed cleanup, synced so that freeing the blocks (discards, journal) is not billed to the next run."""
    shutil.rmtree(path)
    os.sync()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def moto_server(timeout_s: float = 30.0) -> Iterator[str]:
    """A moto S3 server subprocess on a free loopback port; yields its URL and stops it on exit."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the moto S3 server did not start on port {port}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_processes([process])


def _row(case: str, backend: str, src: Path, runs: list[dict[str, float]], essential_s: list[float]) -> dict[str, Any]:
    size_bytes = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    median = {key: statistics.median(run[key] for run in runs) for key in ("store_s", "publish_s", "fetch_s")}
    essential = statistics.median(essential_s)
    return {
        "case": case,
        "backend": backend,
        "size_bytes": size_bytes,
        "num_files": sum(1 for p in src.rglob("*") if p.is_file()),
        **median,
        "essential_s": essential,
        "ratio": median["store_s"] / essential,
        "store_mb_per_s": size_bytes / 1e6 / median["store_s"],
        "runs_store_s": [run["store_s"] for run in runs],
        "runs_essential_s": essential_s,
    }


def _bench_local(case: str, src: Path, work: Path, repeats: int) -> dict[str, Any]:
    files = _files(src)
    runs, essential_s = [], []
    for rep in range(-1, repeats):  # rep -1 is the warm-up
        store = LocalWeightStore(work / "local", f"{case}{rep}")
        run = asyncio.run(_publish_and_fetch(store, src, 0))
        _remove(store.root / store.job_id)
        started = time.perf_counter()
        _essential_local(files, work / "essential")
        essential = time.perf_counter() - started
        _remove(work / "essential")
        if rep >= 0:
            runs.append(run)
            essential_s.append(essential)
    return _row(case, "local", src, runs, essential_s)


def _bench_s3(
    case: str, src: Path, work: Path, repeats: int, endpoint_url: str, multipart_threshold_bytes: int
) -> dict[str, Any]:
    import aioboto3

    files = _files(src)
    session = aioboto3.Session(aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1")

    async def main() -> dict[str, Any]:
        runs, essential_s = [], []
        for rep in range(-1, repeats):  # rep -1 is the warm-up (and creates the bucket)
            store = S3WeightStore(
                BUCKET,
                "bench",
                f"{case}{rep}",
                work / "s3-cache",
                endpoint_url=endpoint_url,
                region="us-east-1",
                session=session,
                multipart_threshold_bytes=multipart_threshold_bytes,
            )
            async with store.client() as s3:
                if rep < 0:
                    await s3.create_bucket(Bucket=BUCKET)
                run = await _publish_and_fetch(store, src, 0)
                await _empty_bucket(s3)
                _remove(store.cache_dir)
                started = time.perf_counter()
                await _essential_s3(s3, files, f"essential/{case}{rep}", work / "ess")
                essential = time.perf_counter() - started
                await _empty_bucket(s3)
                _remove(work / "ess")
            if rep >= 0:
                runs.append(run)
                essential_s.append(essential)
        return _row(case, "s3", src, runs, essential_s)

    return asyncio.run(main())


def run_store_bench(
    synthetic_mb: int = 200, repeats: int = 5, multipart_threshold_mib: int | None = None
) -> dict[str, Any]:
    """Publish-plus-load time over the essential work, per case (default, synthetic) and backend (local, s3);
    `multipart_threshold_mib` None means the store's default (StoreConfig)."""
    multipart_threshold_mib = multipart_threshold_mib or StoreConfig().multipart_threshold_mib
    rows = []
    with tempfile.TemporaryDirectory(prefix="jetroll-bench-store-") as tmp:
        work = Path(tmp)
        default = default_checkpoint(work / "src-default")
        cases = {"default": default, "synthetic": synthetic_checkpoint(work / "src-synthetic", default, synthetic_mb)}
        for case, src in cases.items():
            rows.append(_bench_local(case, src, work / "run", repeats))
        with moto_server() as endpoint_url:
            for case, src in cases.items():
                rows.append(_bench_s3(case, src, work / "run", repeats, endpoint_url, multipart_threshold_mib << 20))
    by_key = {(row["case"], row["backend"]): row for row in rows}
    summary = {
        "local_ratio": by_key["synthetic", "local"]["ratio"],
        "s3_ratio": by_key["synthetic", "s3"]["ratio"],
        "default_local_ratio": by_key["default", "local"]["ratio"],
        "default_s3_ratio": by_key["default", "s3"]["ratio"],
        # how far the S3 server itself is from local disk: the S3 store's time over the local essential work
        "s3_store_over_local_essential": by_key["synthetic", "s3"]["store_s"]
        / by_key["synthetic", "local"]["essential_s"],
        "max_ratio": MAX_RATIO,
    }
    summary["is_within_max"] = summary["local_ratio"] <= MAX_RATIO and summary["s3_ratio"] <= MAX_RATIO
    return {
        "config": {
            "synthetic_mb": synthetic_mb,
            "repeats": repeats,
            "statistic": "median of cold runs after one warm-up; ratio = store publish+fetch / essential work",
            "local_essential": "write + fsync each file, read it back, one sha256 pass on each side",
            "s3_essential": "one PUT per file from memory, one GET per file streamed to a local file (no fsync, as "
            "the store's cache), one sha256 pass on each side; same server and client settings",
            "s3_server": "moto server subprocess on 127.0.0.1 (default settings)",
            "s3_multipart_threshold_mib": multipart_threshold_mib,
            "cpu": platform.processor() or platform.machine(),
            "num_cpus": os.cpu_count(),
        },
        "rows": rows,
        "summary": summary,
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    table = Table(
        title=f"weight store: publish + fetch of one version vs the essential work "
        f"(seconds, median of {config['repeats']})"
    )
    for column in (
        "case",
        "backend",
        "MB",
        "files",
        "publish s",
        "fetch s",
        "store s",
        "essential s",
        "ratio",
        "store MB/s",
    ):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(
            row["case"],
            row["backend"],
            f"{row['size_bytes'] / 1e6:.1f}",
            str(row["num_files"]),
            f"{row['publish_s']:.3f}",
            f"{row['fetch_s']:.3f}",
            f"{row['store_s']:.3f}",
            f"{row['essential_s']:.3f}",
            f"{row['ratio']:.2f}",
            f"{row['store_mb_per_s']:.0f}",
        )
    console = Console()
    console.print(table)
    summary = result["summary"]
    console.print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
