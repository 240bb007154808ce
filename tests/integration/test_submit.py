"""Event-triggered jobs on a real Redis: `jetroll submit`, the watch-mode controller and services, `jetroll status`,
dead-lettered submissions, services joining and leaving jobs, and job configs through S3 (moto)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import msgspec
import pytest
import redis
from helpers import JETROLL, cancel_and_wait, ended, wait_until, wait_until_async

from jetroll.services.launch import watch
from jetroll.services.launch.jobs import load_job_config
from jetroll.shared.config.job import load_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.protocol.bus import FIELD
from jetroll.shared.protocol.events import JobEvent, MetricsEvent, encode
from jetroll.shared.protocol.topology import ACTIVE, JOBS, JOBS_DLQ, STATUS

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
CLI = JETROLL
JOB_TIMEOUT_S = 300.0


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def jobs_redis(redis_url: str) -> Iterator[redis.Redis]:
    """The session's Redis with the global job keys cleared: every test starts with an empty queue and board."""
    client = redis.Redis.from_url(redis_url)
    client.delete(JOBS.name, ACTIVE, STATUS, JOBS_DLQ)
    yield client
    client.delete(JOBS.name, ACTIVE, STATUS, JOBS_DLQ)
    client.close()


def statuses(client: redis.Redis) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in client.hgetall(STATUS).items()}


# --- the watchers' logic, in process, with stand-in service processes ---------------------------------------------

# Stand-ins for `jetroll <service> --config C --run-dir R`; argv: config, run dir, consumer, calls file.
FAKE_CONTROLLER = """
import json, pathlib, sys
config_path, run_dir, consumer, calls = sys.argv[1:]
config = json.loads(pathlib.Path(config_path).read_text())
row = [config["job_id"], consumer, config_path, config["model"]["path"], config["store"]["root"]]
with open(calls, "a") as f:
    f.write(json.dumps(row) + "\\n")
if config["job_id"] == "boom":
    sys.exit(3)
summary = {"steps": 3, "accuracy_before": 0.25, "accuracy_after": 0.5, "ignored": 1}
pathlib.Path(run_dir, "summary.json").write_text(json.dumps(summary))
"""
FAKE_SERVICE = """
import json, os, pathlib, signal, sys, time
config_path, run_dir, consumer, calls = sys.argv[1:]
job_id = json.loads(pathlib.Path(config_path).read_text())["job_id"]
with open(calls, "a") as f:
    f.write(json.dumps([job_id, consumer, os.getpid()]) + "\\n")
if job_id == "crashy":
    sys.exit(1)
if job_id == "stubborn":  # a service whose shutdown hangs: the watcher must kill it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(3600)
"""


def fake_argv(script: str, calls: Path) -> watch.ServiceArgv:
    def argv(name: str, config_path: Path, run_dir: Path, consumer: str) -> list[str]:
        return [sys.executable, "-c", script, str(config_path), str(run_dir), consumer, str(calls)]

    return argv


def read_calls(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Enough of a model dir for resolve_config (ensure_base_model checks config.json is there)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_a_cancelled_watcher_stops_wherever_its_read_was(jobs_redis: redis.Redis, redis_url: str,
                                                         tmp_path: Path) -> None:
    """SIGTERM cancels a watcher mid-read (`jetroll controller --watch`); it must stop every time. redis-py 8.0-8.2
    swallowed a cancellation that landed in a blocking read in a few percent of tries, then hung on the next read."""

    async def scenario() -> None:
        rng = random.Random(0)
        for attempt in range(60):
            watcher = asyncio.create_task(watch.watch_jobs(redis_url, tmp_path / "runs", "controller-test",
                                                           poll_s=0.05))
            await asyncio.sleep(rng.uniform(0.0, 0.15))
            await cancel_and_wait(watcher, f"the watcher (attempt {attempt})", timeout_s=5.0)
            assert watcher.cancelled()

    asyncio.run(scenario())


def test_controller_watcher_dead_letters_bad_jobs_and_runs_the_rest(jobs_redis: redis.Redis, redis_url: str,
                                                                    model_dir: Path, tmp_path: Path) -> None:
    """Malformed, wrong-kind and invalid submissions go to the dlq (failed where a job_id is known); a job whose
    controller keeps failing is failed after its restarts; the jobs after them run, in order, and end `done`."""
    calls = tmp_path / "calls.jsonl"
    runs = tmp_path / "runs"

    def job(event_job_id: str, **config: Any) -> bytes:
        tree = {"model": {"path": str(model_dir)}, "launch": {"max_restarts": 1}, **config}
        return encode(JobEvent(job_id=event_job_id, config=tree))

    unsupported = {"kind": "job", "job_id": "noschema", "schema": 99, "config": {}}
    for payload in (b"\x92not-an-event", msgspec.msgpack.encode(unsupported),
                    encode(MetricsEvent(job_id="m", service="x", values={"y": 1.0}, step=0)),
                    job("badlr", trainer={"lr": -1}), job("mismatch", job_id="other"),
                    job("boom"), job("good1"), job("good2")):
        jobs_redis.xadd(JOBS.name, {FIELD: payload})

    async def scenario() -> None:
        watcher = asyncio.create_task(watch.watch_jobs(redis_url, runs, "controller-test",
                                                       fake_argv(FAKE_CONTROLLER, calls), poll_s=0.05))
        async def done() -> bool:
            return statuses(jobs_redis).get("good2", {}).get("status") == "done"

        await wait_until_async(done, "job good2 to be done", 60, gone=ended(watcher),
                               context=lambda: str(statuses(jobs_redis)))
        assert not watcher.done()  # still watching
        await cancel_and_wait(watcher, "the controller watcher")

    asyncio.run(scenario())
    ran = read_calls(calls)
    assert [(job_id, consumer) for job_id, consumer, *_ in ran] == [
        ("boom", "controller-test"), ("boom", "controller-test-r1"),  # restarted once, as the launcher would
        ("good1", "controller-test"), ("good2", "controller-test")]
    for job_id, _, config_path, model_path, store_root in ran:
        run_dir = (runs / job_id).resolve()
        assert config_path == str(run_dir / "config.json")  # resolved, as `jetroll run` resolves a job
        assert model_path == str(model_dir.resolve()) and store_root == str(run_dir / "store")
    board = statuses(jobs_redis)
    assert board["noschema"]["status"] == "failed" and "unsupported schema 99" in board["noschema"]["error"]
    assert board["badlr"]["status"] == "failed" and "trainer.lr" in board["badlr"]["error"]
    assert board["mismatch"]["status"] == "failed" and "differs" in board["mismatch"]["error"]
    assert board["boom"]["status"] == "failed"
    assert board["boom"]["error"] == "RuntimeError: the controller exited with 3 after 1 restarts; see its log"
    for job_id in ("good1", "good2"):
        record = board[job_id]
        assert record["status"] == "done" and record["steps"] == 3 and record["accuracy_after"] == 0.5
        assert "ignored" not in record
        assert record["submitted_at"] <= record["started_at"] <= record["finished_at"]
        assert record["run_dir"] == str((runs / job_id).resolve())
    assert board["good1"]["finished_at"] <= board["good2"]["started_at"]  # one at a time, in order
    dlq = [{k.decode(): v for k, v in fields.items()} for _, fields in jobs_redis.xrange(JOBS_DLQ)]
    reasons = [r["reason"].decode() for r in dlq]
    assert len(reasons) == 5, reasons
    assert sum(r.startswith("undecodable event") for r in reasons) == 2, reasons
    assert "expected a job event, got a metrics event" in reasons
    assert all(r["stream"] == JOBS.name.encode() and r["payload"] for r in dlq)
    announced = [msgspec.msgpack.decode(f[FIELD])["job_id"] for _, f in jobs_redis.xrange(ACTIVE)]
    assert announced == ["boom", "good1", "good2"]
    assert jobs_redis.xinfo_groups(JOBS.name)[0]["pending"] == 0  # every entry acked, bad ones included


def test_services_join_running_jobs_leave_ended_ones_and_fail_them_after_restarts(
        jobs_redis: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """A service joins a job already running when it starts, leaves (stopping its process, killing one that
    ignores SIGTERM) when the job ends, and fails a job whose process keeps exiting, naming itself."""
    config = load_config(SMOKE, ["launch.max_restarts=1"]).model_dump(mode="json")
    calls = tmp_path / "calls.jsonl"

    def announce(client: redis.Redis, job_id: str) -> None:
        client.xadd(ACTIVE, {FIELD: encode(JobEvent(job_id=job_id, config={**config, "job_id": job_id}))})

    def set_status(job_id: str, status: str) -> None:
        jobs_redis.hset(STATUS, job_id, json.dumps({"status": status}))

    def wait_for_calls(num: int) -> list[list]:
        return wait_until(lambda: len(read_calls(calls)) >= num and read_calls(calls), f"{num} service starts", 20,
                          interval_s=0.2)

    async def scenario() -> None:
        for job_id, status in (("old", "done"), ("live", "running")):  # `live` runs before the service starts
            set_status(job_id, status)
            announce(jobs_redis, job_id)
        service = asyncio.create_task(watch.watch_service("rollout", redis_url, tmp_path / "runs", "rollout-t",
                                                          fake_argv(FAKE_SERVICE, calls), poll_s=0.05,
                                                          stop_timeout_s=0.5))
        await asyncio.to_thread(wait_for_calls, 1)
        set_status("live", "done")
        set_status("stubborn", "running")
        jobs_redis.xadd(ACTIVE, {FIELD: b"garbage"})  # skipped, never fatal
        announce(jobs_redis, "stubborn")
        await asyncio.to_thread(wait_for_calls, 2)
        set_status("stubborn", "done")
        set_status("crashy", "running")
        announce(jobs_redis, "crashy")
        async def failed() -> bool:
            return statuses(jobs_redis)["crashy"]["status"] == "failed"

        await wait_until_async(failed, "job crashy to fail", 20, interval_s=0.02, gone=ended(service),
                               context=lambda: str(read_calls(calls)))
        assert not service.done()
        await cancel_and_wait(service, "the service watcher")

    asyncio.run(scenario())
    ran = read_calls(calls)
    assert [(job_id, consumer) for job_id, consumer, _ in ran] == [
        ("live", "rollout-t"), ("stubborn", "rollout-t"), ("crashy", "rollout-t"), ("crashy", "rollout-t-r1")]
    for _, _, pid in ran:  # stopped, or killed, and reaped
        assert not Path(f"/proc/{pid}").exists(), pid
    error = statuses(jobs_redis)["crashy"]["error"]
    assert error == "service rollout (rollout-t) exited with 1 after 1 restarts", error


# --- the real services as processes ---------------------------------------------------------------------------------


@dataclass
class Stack:
    """Watch-mode services as subprocesses, logging to files, all stopped (SIGTERM, then SIGKILL) at the end."""

    redis_url: str
    workdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def runs_dir(self) -> Path:
        return self.workdir / "runs"

    def start(self, name: str, *args: str) -> None:
        with self.log(name).open("ab") as out:
            self.procs[name] = subprocess.Popen([*CLI, *args, "--redis-url", self.redis_url], stdout=out,
                                                stderr=subprocess.STDOUT, cwd=self.workdir)

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def logs(self) -> str:
        return "\n".join(f"== {name}\n{self.log(name).read_text()[-4000:]}" for name in self.procs)

    def stop(self) -> dict[str, int]:
        for process in self.procs.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = {}
        for name, process in self.procs.items():
            try:
                codes[name] = process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait()
        return codes


@pytest.fixture
def stack(jobs_redis: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tmp_path)
    yield stack
    stack.stop()


@pytest.mark.slow
def test_submitted_jobs_run_on_watching_services(stack: Stack, jobs_redis: redis.Redis, tmp_path: Path) -> None:
    """`jetroll submit` two smoke jobs to watching services; a rollout worker that starts while the first runs joins
    it, and every service moves on to the second. Bad submissions before them are failed and dead-lettered."""
    cache = tmp_path / "model-cache"
    first, second = f"s{uuid.uuid4().hex[:8]}", f"s{uuid.uuid4().hex[:8]}"
    stack.start("controller", "controller", "--watch", "--runs-dir", str(stack.runs_dir))
    for name in ("trainer", "reward"):
        stack.start(name, name, "--watch", "--runs-dir", str(stack.runs_dir), "--heartbeat-file",
                    str(tmp_path / f"{name}.beat"))
    jobs_redis.xadd(JOBS.name, {FIELD: b"\x92not-an-event"})
    jobs_redis.xadd(JOBS.name, {FIELD: encode(JobEvent(job_id="badjob", config={"trainer": {"group_size": 0}}))})
    for job_id, steps in ((first, 4), (second, 2)):
        result = cli("submit", str(SMOKE), "--to", "redis", "--redis-url", stack.redis_url, "--set",
                     f"job_id={job_id}", "--set", f"model.cache_dir={cache}", "--set", f"trainer.max_steps={steps}")
        assert result.returncode == 0 and result.stdout.strip() == job_id, result.stderr

    def status(job_id: str) -> str | None:
        assert all(p.poll() is None for p in stack.procs.values()), stack.logs()
        return statuses(jobs_redis).get(job_id, {}).get("status")

    wait_until(lambda: status(first) == "running", "the first job to start", 120, interval_s=0.2, context=stack.logs)
    assert status(second) == "queued"  # one job at a time
    stack.start("rollout", "rollout", "--watch", "--runs-dir", str(stack.runs_dir))  # joins the running job
    wait_until(lambda: status(second) in ("done", "failed"), "both jobs to end", JOB_TIMEOUT_S, interval_s=0.2,
               context=stack.logs)
    board = statuses(jobs_redis)
    assert board[first]["status"] == board[second]["status"] == "done", (board, stack.logs())
    for job_id, steps in ((first, 4), (second, 2)):
        record = board[job_id]
        assert record["steps"] == steps
        assert 0.0 <= record["accuracy_before"] <= 1.0 and 0.0 <= record["accuracy_after"] <= 1.0
        assert record["rollout_tokens_per_s"] > 0 and math.isfinite(record["mismatch_mean_abs_logprob"])
        summary = json.loads((stack.runs_dir / job_id / "summary.json").read_text())
        assert summary["steps"] == steps and summary["accuracy_after"] == record["accuracy_after"]
    assert board[first]["finished_at"] <= board[second]["started_at"]
    assert board["badjob"]["status"] == "failed" and "trainer.group_size" in board["badjob"]["error"]
    assert len(jobs_redis.xrange(JOBS_DLQ)) == 2
    assert all((tmp_path / f"{name}.beat").is_file() for name in ("trainer", "reward"))

    table = cli("status", "--redis-url", stack.redis_url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:2] == ["JOB", "STATUS"]
    assert any(line.split()[:2] == [first, "done"] and "4 steps, accuracy" in line for line in lines), table.stdout
    assert any(line.split()[:2] == ["badjob", "failed"] for line in lines), table.stdout
    one = cli("status", second, "--json", "--redis-url", stack.redis_url)
    assert one.returncode == 0 and json.loads(one.stdout)["steps"] == 2, one.stderr
    assert cli("status", "nosuchjob", "--redis-url", stack.redis_url).returncode == 1

    services = ("rollout", "reward", "trainer")
    wait_until(lambda: all(f"leaves job {second}" in stack.log(name).read_text() for name in services),
               "every service to leave the second job", 60, interval_s=0.2, context=stack.logs)
    for name in services:
        log = stack.log(name).read_text()
        for job_id in (first, second):
            assert f"joins job {job_id}" in log and f"leaves job {job_id}" in log, log[-4000:]
        assert "failed in job" not in log, log[-4000:]  # no restart was needed
    codes = stack.stop()  # the watchers were still up, waiting for the next job; SIGTERM stops them cleanly
    assert all(code in (0, 143, -signal.SIGTERM) for code in codes.values()), (codes, stack.logs())


def test_submit_rejects_bad_input_with_one_line(tmp_path: Path) -> None:
    result = cli("submit", str(SMOKE), "--set", "trainer.lr=-1", "--redis-url", "redis://127.0.0.1:1/0")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "trainer.lr" in result.stderr
    result = cli("submit", str(SMOKE), "--set", "job_id=jobs", "--redis-url", "redis://127.0.0.1:1/0")
    assert result.returncode == 2 and "reserved" in result.stderr, result.stderr
    result = cli("submit", str(SMOKE), "--to", "s3", env={"JETROLL_JOBS_URI": ""})
    assert result.returncode == 2 and "--jobs-uri" in result.stderr, result.stderr
    result = cli("submit", str(SMOKE), "--redis-url", "redis://127.0.0.1:1/0")  # nothing listens on port 1
    assert result.returncode == 1 and result.stderr.startswith("jetroll: cannot submit job"), result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr


# --- job configs through S3 -----------------------------------------------------------------------------------------

@pytest.mark.job  # `jetroll run` of the submitted job's URI
def test_submit_to_s3_and_run_reads_the_job_uri(s3_url: str, aws_env: dict[str, str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = f"jobs-{uuid.uuid4().hex[:10]}"
    s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    result = cli("submit", str(SMOKE), "--to", "s3", "--jobs-uri", f"s3://{bucket}/jobs/", "--endpoint-url", s3_url,
                 "--set", "job_id=s3job", "--set", "trainer.lr=1e-05", env=aws_env)
    assert result.returncode == 0 and result.stdout.strip() == "s3job", result.stderr
    assert f"s3://{bucket}/jobs/s3job.json" in result.stderr
    expected = load_config(SMOKE, ["job_id=s3job", "trainer.lr=1e-05"])
    body = s3.get_object(Bucket=bucket, Key="jobs/s3job.json")["Body"].read()
    assert json.loads(body) == expected.model_dump(mode="json")

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_url)  # what AWS Batch's `jetroll run s3://...` reads
    loaded = load_job_config(f"s3://{bucket}/jobs/s3job.json")
    assert loaded == expected and loaded.trainer.lr == 1e-05
    assert load_job_config(f"s3://{bucket}/jobs/s3job.json", ["trainer.max_steps=7"]).trainer.max_steps == 7
    s3.put_object(Bucket=bucket, Key="jobs/y.yaml", Body=SMOKE.read_bytes())
    assert load_job_config(f"s3://{bucket}/jobs/y.yaml", ["job_id=y"]) == load_config(SMOKE, ["job_id=y"])
    s3.put_object(Bucket=bucket, Key="jobs/bad.json", Body=b'{"trainer": {"lr": -1}}')
    with pytest.raises(ConfigError, match="trainer.lr"):
        load_job_config(f"s3://{bucket}/jobs/bad.json")
    with pytest.raises(ConfigError, match=f"cannot read config s3://{bucket}/jobs/missing.json"):
        load_job_config(f"s3://{bucket}/jobs/missing.json")
    result = cli("run", f"s3://{bucket}/jobs/missing.json", env={**aws_env, "AWS_ENDPOINT_URL": s3_url})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "cannot read config s3://" in result.stderr, result.stderr
