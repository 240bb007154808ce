"""AWS Lambda `job_trigger`: an S3 "Object Created" event (delivered by EventBridge) for a job file under jobs/
becomes one AWS Batch job that runs `jetroll run s3://bucket/key` (the job definition's `Ref::job_uri`).

Event: {"source": "aws.s3", "detail-type": "Object Created", "detail": {"bucket": {"name": ...},
"object": {"key": ...}, ...}}; the key is URL-encoded as in S3 notifications. Environment: JOB_QUEUE and
JOB_DEFINITION (names or ARNs). Keys outside jobs/ or not .yaml/.yml/.json are logged and ignored.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any
from urllib.parse import unquote_plus

import boto3

JOBS_PREFIX = "jobs/"
JOB_SUFFIXES = (".yaml", ".yml", ".json")
MAX_JOB_NAME_CHARS = 128  # Batch: letters, digits, '-' and '_', starting with a letter or digit

log = logging.getLogger("jetroll.job_trigger")
log.setLevel(logging.INFO)


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Submit the job file named by `event`; returns what was done (submitted or ignored, and why)."""
    bucket, key = parse_event(event)
    job_uri = f"s3://{bucket}/{key}"
    if not key.startswith(JOBS_PREFIX) or not key.lower().endswith(JOB_SUFFIXES):
        reason = f"{job_uri} is not a job file ({JOBS_PREFIX}*{{{','.join(JOB_SUFFIXES)}}})"
        log.info("job_trigger: ignored: %s", reason)
        return {"submitted": False, "job_uri": job_uri, "reason": reason}
    queue, definition = _env("JOB_QUEUE"), _env("JOB_DEFINITION")
    name = job_name(key)
    response = boto3.client("batch").submit_job(
        jobName=name, jobQueue=queue, jobDefinition=definition, parameters={"job_uri": job_uri}
    )
    log.info("job_trigger: submitted %s as Batch job %s (%s)", job_uri, name, response["jobId"])
    return {"submitted": True, "job_uri": job_uri, "job_name": name, "job_id": response["jobId"]}


def parse_event(event: Any) -> tuple[str, str]:
    """(bucket, decoded key) of an S3 "Object Created" EventBridge event; ValueError naming what is wrong."""
    if not isinstance(event, dict):
        raise ValueError(f"job_trigger: the event must be a JSON object, got {type(event).__name__}")
    for field, expected in (("source", "aws.s3"), ("detail-type", "Object Created")):
        if event.get(field) != expected:
            raise ValueError(f"job_trigger: event {field} is {event.get(field)!r}, expected {expected!r} "
                             "(an S3 Object Created event from EventBridge)")
    detail = event.get("detail")
    bucket = _field(detail, "bucket", "name")
    key = _field(detail, "object", "key")
    return bucket, unquote_plus(key)


def job_name(key: str) -> str:
    """A Batch job name from the key: `jetroll-` + the file stem, other characters as '-', at most 128 chars."""
    stem = key.removeprefix(JOBS_PREFIX).rsplit(".", 1)[0]
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "-", stem).strip("-_")
    return f"jetroll-{cleaned}"[:MAX_JOB_NAME_CHARS].rstrip("-_") if cleaned else "jetroll-job"


def _field(detail: Any, section: str, name: str) -> str:
    path = f"detail.{section}.{name}"
    if not isinstance(detail, dict):
        raise ValueError(f"job_trigger: event has no detail object, so no {path}")
    value = detail.get(section, {}).get(name) if isinstance(detail.get(section), dict) else None
    if not isinstance(value, str) or not value:
        raise ValueError(f"job_trigger: event has no {path} (got {value!r})")
    return value


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"job_trigger: environment variable {name} is not set (infra/lambda.tf sets JOB_QUEUE "
                           "and JOB_DEFINITION to the Batch job queue and job definition ARNs)")
    return value
