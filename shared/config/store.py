"""store: where versioned weights live (a local directory or S3)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from jetroll.shared.schema import Strict


class StoreConfig(Strict):
    """Where weight versions and checkpoints live: a local directory, or S3 (any S3-compatible server)."""

    type: Literal["local", "s3"] = Field("local", description="weight store backend; a store.uri alone selects s3")
    root: str = Field(
        "", description="local store root, or the S3 store's cache of fetched files; empty means <run-dir>/store"
    )
    uri: str = Field("", description="s3://bucket/prefix for the S3 store; empty keeps the local directory")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); None means AWS")
    region: str | None = Field(None, description="S3 region; None means the AWS default chain (env, ~/.aws)")
    keep_last: int = Field(3, ge=1, description="retention: versions kept besides checkpoints")
    keep_checkpoints: int = Field(2, ge=1, description="retention: the newest trainer states kept besides every "
                                  "trainer.checkpoint_every-th (a resumed trainer falls back past one that fails to "
                                  "verify)")
    poll_interval_s: float = Field(
        5.0, gt=0, description="rollout workers also poll LATEST this often, in case a weights event is missed"
    )
    multipart_threshold_mib: int = Field(
        200, ge=5, description="S3: files this big or bigger upload as parallel 16 MiB multipart parts"
    )
    s3_max_attempts: int = Field(
        12, ge=1, description="S3: attempts per request (botocore's standard retry mode, random waits of up to 20 s "
        "between them): 12 ride out an outage of about a minute and more; then the operation fails")

    @model_validator(mode="before")
    @classmethod
    def _uri_selects_s3(cls, data: Any) -> Any:
        # `--set store.uri=s3://...` alone is enough; an explicit type is still checked against the uri below
        if isinstance(data, dict) and data.get("uri") and "type" not in data:
            return {**data, "type": "s3"}
        return data

    @model_validator(mode="after")
    def _uri_matches_type(self) -> StoreConfig:
        if self.type == "local" and self.uri:
            raise ValueError(f"store.type 'local' conflicts with store.uri {self.uri!r}; drop one of them")
        if self.type == "s3":
            bucket, _ = self.bucket_and_prefix
            is_bucket = (
                3 <= len(bucket) <= 63
                and bucket[0].isalnum()
                and bucket[-1].isalnum()
                and all(c.islower() or c.isdigit() or c in ".-" for c in bucket)
            )
            if not self.uri.startswith("s3://") or not is_bucket:
                raise ValueError(
                    f"store.uri must look like s3://bucket/prefix (bucket: 3-63 lowercase letters, "
                    f"digits, '.' or '-'), got {self.uri!r}"
                )
        return self

    @property
    def bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = self.uri.removeprefix("s3://").partition("/")
        return bucket, prefix.strip("/")
