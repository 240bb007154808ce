"""The weight store: versioned HF-format model dirs with sha256 manifests, a forward-only LATEST, checkpoints."""

from __future__ import annotations

from pathlib import Path

from jetroll.shared.config.store import StoreConfig
from jetroll.shared.store.base import STORE_TYPES, WeightStore
from jetroll.shared.store.local import LocalWeightStore
from jetroll.shared.store.s3 import S3WeightStore


def setup_store(config: StoreConfig, job_id: str, run_dir: Path) -> WeightStore:
    """Build the configured store; an empty root means `<run_dir>/store` (for S3, the cache of fetched files)."""
    root = Path(config.root).expanduser() if config.root else Path(run_dir) / "store"
    if config.type == "local":
        return LocalWeightStore(root, job_id)
    if config.type == "s3":
        bucket, prefix = config.bucket_and_prefix
        return S3WeightStore(
            bucket,
            prefix,
            job_id,
            root,
            endpoint_url=config.endpoint_url,
            region=config.region,
            multipart_threshold_bytes=config.multipart_threshold_mib << 20,
            max_attempts=config.s3_max_attempts,
        )
    raise ValueError(f"unknown store type {config.type!r}; valid: {list(STORE_TYPES)}")
