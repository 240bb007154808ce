"""Event-triggered jobs: submitting to the job queue (shared/protocol/jobs.py) or to S3, reading job configs from
either, and the status table.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from jetroll.shared.config.job import JobConfig, config_to_json, config_tree, load_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.protocol.events import JobEvent
from jetroll.shared.protocol.jobs import JobQueue
from jetroll.shared.protocol.topology import RESERVED_JOB_IDS

FINAL_STATUSES = ("done", "failed")
SUMMARY_FIELDS = ("steps", "accuracy_before", "accuracy_after", "rollout_tokens_per_s", "mismatch_mean_abs_logprob",
                  "groups_dropped", "wall_time_s")


def check_job_id(job_id: str) -> None:
    if job_id in RESERVED_JOB_IDS or not job_id or "/" in job_id:
        raise ConfigError(f"invalid config: job_id: {job_id!r} is reserved or not a plain name")


async def submit_to_redis(config: JobConfig, redis_url: str) -> JobEvent:
    """Queue the job on the job queue with a fresh `queued` status record, in one transaction."""
    check_job_id(config.job_id)
    event = JobEvent(job_id=config.job_id, config=config_tree(config))
    async with JobQueue(redis_url) as queue:
        await queue.submit(event)
    return event


def _split_s3(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
        raise ConfigError(f"expected an s3://bucket/key URI, got {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


def submit_to_s3(config: JobConfig, jobs_uri: str, endpoint_url: str | None = None) -> str:
    """Put the validated config as `<jobs_uri>/<job_id>.json` (what the S3 -> EventBridge trigger reacts to);
    returns the object's URI. Credentials and, unless given, the endpoint come from the AWS environment."""
    import boto3

    check_job_id(config.job_id)
    bucket, prefix = _split_s3(jobs_uri)
    key = f"{prefix.strip('/')}/{config.job_id}.json".lstrip("/")
    body = config_to_json(config).encode()
    boto3.client("s3", endpoint_url=endpoint_url).put_object(Bucket=bucket, Key=key, Body=body,
                                                             ContentType="application/json")
    return f"s3://{bucket}/{key}"


def fetch_job_uri(uri: str) -> str:
    """The text of an s3://bucket/key job config (boto3's credential chain; AWS_ENDPOINT_URL for other servers)."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _split_s3(uri)
    try:
        body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    except (BotoCoreError, ClientError) as exc:
        raise ConfigError(f"cannot read config {uri}: {exc}".splitlines()[0]) from exc
    return body.decode()


def load_job_config(source: str | Path, overrides: list[str] = ()) -> JobConfig:
    """`load_config` for a local file or an s3:// job URI (JSON or YAML), with the same one-line errors."""
    if not str(source).startswith("s3://"):
        return load_config(source, overrides)
    text = fetch_job_uri(str(source))
    try:
        text = yaml.safe_dump(json.loads(text))  # PyYAML reads JSON's 1e-05 as a string; YAML keeps it a float
    except ValueError:
        pass  # not JSON: read as YAML
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / (PurePosixPath(_split_s3(str(source))[1]).name or "job.yaml")
        path.write_text(text)
        try:
            return load_config(path, overrides)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace(str(path), str(source))) from None


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _took(record: dict[str, Any]) -> str:
    start, end = record.get("started_at"), record.get("finished_at") or (
        time.time() if record.get("status") == "running" else None)
    return f"{end - start:.0f}s" if start and end else "-"


def _result(record: dict[str, Any]) -> str:
    if record.get("error"):
        return record["error"]
    if record.get("accuracy_after") is not None:
        before, after = record.get("accuracy_before", math.nan), record["accuracy_after"]
        return f"{record.get('steps', '?')} steps, accuracy {before:.3f} -> {after:.3f}"
    return f"{record['steps']} steps, no held-out eval" if "steps" in record else ""


def format_status(records: dict[str, dict[str, Any]]) -> str:
    """A small table, oldest submission first."""
    rows = [("JOB", "STATUS", "SUBMITTED", "TOOK", "RESULT")]
    for job_id, record in sorted(records.items(), key=lambda kv: kv[1].get("submitted_at") or 0):
        rows.append((job_id, record.get("status", "?"), _when(record.get("submitted_at")), _took(record),
                     _result(record)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4])
                     .rstrip() for row in rows)


def print_dead_letters(job_id: str, redis_url: str | None, num_newest: int, *, as_json: bool) -> int:
    """`jetroll dlq`: a job's dead letters counted by stream and kind of reason, then the newest `num_newest`."""
    import asyncio

    from jetroll.shared.protocol.bus import RedisBus
    from jetroll.shared.protocol.dead_letters import DeadLetters, dead_letter_counts

    if not redis_url:
        print("jetroll: dlq needs --redis-url (or JETROLL_REDIS_URL)", file=sys.stderr)
        return 2

    async def read() -> list[dict[str, str | bytes]]:
        bus = RedisBus(redis_url, job_id)
        try:
            return await DeadLetters(bus).read()
        finally:
            await bus.close()

    records = asyncio.run(read())
    newest = [{k: v for k, v in r.items() if k != "payload"} for r in records[-num_newest:]] if num_newest else []
    counts = dead_letter_counts(records)
    if as_json:
        print(json.dumps({"job_id": job_id, "total": len(records), "by_reason": counts, "newest": newest}, indent=2))
        return 0
    print(f"{len(records)} dead letters for job {job_id}")
    for reason, count in counts.items():
        print(f"{count:8d}  {reason}")
    for record in newest:
        print(f"{record['dlq_id']}  {record['stream']} {record['entry_id']}: {record['reason']}")
    return 0
