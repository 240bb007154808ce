"""functions/job_trigger.py against moto's Batch (in-process, no Docker): an S3 "Object Created" EventBridge event
for a jobs/ file submits exactly one job with job_uri = s3://bucket/key; anything else submits nothing."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from jetroll.functions import job_trigger

REGION = "us-east-1"
ACCOUNT = "123456789012"
BUCKET = f"jetroll-{ACCOUNT}-{REGION}"
BATCH_STATUSES = ("SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING", "SUCCEEDED", "FAILED")


def s3_object_created(bucket: str, key: str, size: int, etag: str) -> dict[str, Any]:
    """An "Object Created" event as S3 sends it to EventBridge (docs: AmazonS3/latest/userguide/ev-events.html)."""
    return {
        "version": "0",
        "id": "17793124-05d4-b198-2fde-7ededc63b103",
        "detail-type": "Object Created",
        "source": "aws.s3",
        "account": ACCOUNT,
        "time": "2025-06-01T12:00:00Z",
        "region": REGION,
        "resources": [f"arn:aws:s3:::{bucket}"],
        "detail": {
            "version": "0",
            "bucket": {"name": bucket},
            "object": {
                "key": key,
                "size": size,
                "etag": etag,
                "version-id": "IYV3p45BT0ac8hjHg1houSdS1a.Mro8e",
                "sequencer": "617f08299329d189",
            },
            "request-id": "N4N7GDK58NMKJ12R",
            "requester": ACCOUNT,
            "source-ip-address": "1.2.3.4",
            "reason": "PutObject",
        },
    }


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """moto's S3 and Batch with the stack's queue and GPU job definition; JOB_QUEUE/JOB_DEFINITION set as
    infra/lambda.tf sets them (ARNs)."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(name, value)
    with mock_aws(config={"batch": {"use_docker": False}}):
        iam = boto3.client("iam")
        ec2 = boto3.client("ec2")
        batch = boto3.client("batch")
        s3 = boto3.client("s3")
        role = iam.create_role(
            RoleName="jetroll-batch-service",
            AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Principal": {"Service": "batch.amazonaws.com"}, "Action": "sts:AssumeRole"}]}),
        )["Role"]["Arn"]
        iam.create_instance_profile(InstanceProfileName="jetroll-batch-instance")
        iam.add_role_to_instance_profile(InstanceProfileName="jetroll-batch-instance", RoleName="jetroll-batch-service")
        profile = iam.get_instance_profile(InstanceProfileName="jetroll-batch-instance")["InstanceProfile"]["Arn"]
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24")["Subnet"]["SubnetId"]
        group = ec2.create_security_group(GroupName="jetroll-batch", Description="batch", VpcId=vpc)["GroupId"]
        environment = batch.create_compute_environment(
            computeEnvironmentName="jetroll-gpu", type="MANAGED", state="ENABLED", serviceRole=role,
            computeResources={"type": "EC2", "minvCpus": 0, "maxvCpus": 64, "instanceTypes": ["g6e.2xlarge"],
                              "subnets": [subnet], "securityGroupIds": [group], "instanceRole": profile},
        )["computeEnvironmentArn"]
        queue = batch.create_job_queue(
            jobQueueName="jetroll-gpu", state="ENABLED", priority=1,
            computeEnvironmentOrder=[{"order": 1, "computeEnvironment": environment}],
        )["jobQueueArn"]
        definition = batch.register_job_definition(
            jobDefinitionName="jetroll-job", type="container",
            containerProperties={
                "image": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/jetroll/job:0.1.0",
                "command": ["jetroll", "run", "Ref::job_uri"],
                "resourceRequirements": [{"type": "GPU", "value": "1"}, {"type": "VCPU", "value": "8"},
                                         {"type": "MEMORY", "value": "60000"}],
            },
        )["jobDefinitionArn"]
        s3.create_bucket(Bucket=BUCKET)
        monkeypatch.setenv("JOB_QUEUE", queue)
        monkeypatch.setenv("JOB_DEFINITION", definition)
        yield {"batch": batch, "s3": s3, "queue": queue, "definition": definition}


def _uploaded(aws: dict[str, Any], key: str) -> dict[str, Any]:
    """Put a job file at `key` and return the event S3 would emit for it (key URL-encoded as S3 does)."""
    body = json.dumps({"job_id": "3f2a9c1e", "tasks": [{"name": "arithmetic"}]}).encode()
    etag = aws["s3"].put_object(Bucket=BUCKET, Key=key, Body=body)["ETag"].strip('"')
    encoded = key.replace(" ", "+").replace("=", "%3D")
    return s3_object_created(BUCKET, encoded, len(body), etag)


def _jobs(aws: dict[str, Any]) -> list[dict[str, Any]]:
    batch = aws["batch"]
    ids = [job["jobId"] for status in BATCH_STATUSES
           for job in batch.list_jobs(jobQueue=aws["queue"], jobStatus=status)["jobSummaryList"]]
    return batch.describe_jobs(jobs=ids)["jobs"] if ids else []


def test_a_job_file_submits_exactly_one_batch_job(aws: dict[str, Any]) -> None:
    result = job_trigger.handler(_uploaded(aws, "jobs/3f2a9c1e.json"), None)

    assert result["submitted"] is True and result["job_uri"] == f"s3://{BUCKET}/jobs/3f2a9c1e.json"
    (job,) = _jobs(aws)
    assert job["jobId"] == result["job_id"]
    assert job["jobName"] == "jetroll-3f2a9c1e"
    assert job["jobDefinition"] == aws["definition"]
    assert job["jobQueue"] == aws["queue"]
    assert job["parameters"] == {"job_uri": f"s3://{BUCKET}/jobs/3f2a9c1e.json"}


def test_the_key_is_url_decoded_and_the_job_name_sanitised(aws: dict[str, Any]) -> None:
    result = job_trigger.handler(_uploaded(aws, "jobs/team a/lr=1e-4 run.yaml"), None)

    (job,) = _jobs(aws)
    assert job["parameters"] == {"job_uri": f"s3://{BUCKET}/jobs/team a/lr=1e-4 run.yaml"}
    assert job["jobName"] == result["job_name"] == "jetroll-team-a-lr-1e-4-run"


@pytest.mark.parametrize("key", ["weights/job-1/weights/v000001/manifest.json", "jobs/notes.txt", "jobsx/a.yaml"])
def test_other_keys_submit_nothing(aws: dict[str, Any], key: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="jetroll.job_trigger"):
        result = job_trigger.handler(_uploaded(aws, key), None)

    assert result["submitted"] is False and "not a job file" in result["reason"]
    assert "ignored" in caplog.text and key in caplog.text
    assert _jobs(aws) == []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e: e["detail"].pop("object"), "detail.object.key"),
        (lambda e: e["detail"]["bucket"].pop("name"), "detail.bucket.name"),
        (lambda e: e.pop("detail"), "no detail object"),
        (lambda e: e.update({"detail-type": "Object Deleted"}), "detail-type"),
        (lambda e: e.update({"source": "aws.ec2"}), "source"),
    ],
)
def test_a_malformed_event_is_a_clear_error(aws: dict[str, Any], mutate: Any, message: str) -> None:
    event = copy.deepcopy(s3_object_created(BUCKET, "jobs/a.yaml", 10, "0" * 32))
    mutate(event)
    with pytest.raises(ValueError, match=message):
        job_trigger.handler(event, None)
    with pytest.raises(ValueError, match="JSON object"):
        job_trigger.handler([], None)  # type: ignore[arg-type]
    assert _jobs(aws) == []


def test_missing_environment_is_a_clear_error(aws: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOB_DEFINITION")
    with pytest.raises(RuntimeError, match="JOB_DEFINITION is not set"):
        job_trigger.handler(_uploaded(aws, "jobs/a.yaml"), None)
    assert _jobs(aws) == []


@pytest.mark.parametrize(
    ("key", "name"),
    [("jobs/a.yaml", "jetroll-a"), ("jobs/.yaml", "jetroll-job"), ("jobs/ü/é.json", "jetroll-job"),
     ("jobs/" + "x" * 300 + ".yml", "jetroll-" + "x" * 120)],
)
def test_job_names_are_valid_batch_names(key: str, name: str) -> None:
    got = job_trigger.job_name(key)
    assert got == name and len(got) <= 128
    assert all(c.isascii() and (c.isalnum() or c in "-_") for c in got) and got[0].isalnum()
