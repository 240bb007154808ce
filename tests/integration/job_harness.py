"""The job harness: whole jobs through `jetroll run` as subprocesses, their services, logs, streams and ledger.
Its fixtures (`model_path`, `start_job`) are in conftest.py."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from helpers import JETROLL, T, wait_until

from jetroll.shared.config.launch import RedisConfig
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import AnyEvent, decode
from jetroll.shared.protocol.ids import group_id
from jetroll.shared.protocol.ledger import Ledger, LedgerTotals, Outcome

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
JOB_TIMEOUT_S = 180.0
# replicas: the Ray launcher's; reward:celery:*: the Celery backend's idempotency records, which expire
JOB_KEYS = {"groups:default", "episodes:default", "traj:raw", "traj:scored", "metrics", "weights", "dlq", "ledger",
            "ledger:totals", "seen:reward", "in_flight", "num_admitted", "replicas", "reward:celery:*"}


@dataclass
class Job:
    """One `jetroll run` subprocess; stdout and stderr go to files so a full pipe never stalls it."""

    job_id: str
    run_dir: Path
    process: subprocess.Popen[bytes]
    logs: dict[str, Path] = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.json"  # the launcher passes this to every service

    def stderr(self) -> str:
        return self.logs["stderr"].read_text()

    def exited(self) -> str:
        """Why the job can no longer get anywhere ("" while it runs)."""
        code = self.process.poll()
        return "" if code is None else f"job {self.job_id} exited ({code})"

    def report(self) -> str:
        return f"stderr:\n{self.stderr()}\n{service_logs(self.run_dir)}"

    def wait_until(self, predicate: Callable[[], T | None], what: str, timeout_s: float = 120.0) -> T:
        return wait_until(predicate, what, timeout_s, gone=self.exited, context=self.report)

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"job {self.job_id} did not finish in {timeout_s:.0f}s; stderr:\n{self.stderr()}\n"
                        f"{service_logs(self.run_dir)}")

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def service_log(self, name: str) -> str:
        return (self.run_dir / "logs" / f"{name}.log").read_text()


def service_logs(run_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))


def launch(workdir: Path, redis_url: str | None, model_path: str, *overrides: str, job_id: str | None = None,
           run_dir: Path | None = None, ignore_sigint: bool = False) -> Job:
    """Start `jetroll run configs/smoke.yaml` on the test Redis (None: the job's own) with the session's base model
    (`ignore_sigint`: started as a shell starts `cmd &`, with SIGINT ignored)."""
    job_id = job_id or f"t{uuid.uuid4().hex[:8]}"
    run_dir = run_dir or workdir / job_id
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*JETROLL, "run", str(SMOKE), *(["--redis-url", redis_url] if redis_url else []), "--run-dir", str(run_dir)]
    for item in (f"model.path={model_path}", f"job_id={job_id}", *overrides):
        cmd += ["--set", item]
    logs = {name: workdir / f"{job_id}-{uuid.uuid4().hex[:4]}.{name}" for name in ("stdout", "stderr")}
    with logs["stdout"].open("wb") as out, logs["stderr"].open("wb") as err:
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
        process = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=workdir, preexec_fn=ignore)
    return Job(job_id, run_dir, process, logs)


def stop(job: Job) -> None:
    """Stop a job still running (SIGINT: the launcher stops its services in order) and any service left behind."""
    if job.process.poll() is None:
        job.process.send_signal(signal.SIGINT)
        try:
            job.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.process.kill()
    for pid in service_pids(None, job.config_path):
        os.kill(pid, signal.SIGKILL)


def service_pids(kind: str | None, config_path: Path) -> list[int]:
    """PIDs of `python -m jetroll.services.cli <kind> --config <config_path> ...` (any kind when None)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"jetroll.services.cli" not in args or str(config_path).encode() not in args:
            continue
        i = args.index(b"jetroll.services.cli")
        if len(args) > i + 1 and (kind is None or args[i + 1] == kind.encode()):
            pids.append(int(entry.name))
    return pids


def kill_service(job: Job, kind: str, not_pid: int | None = None) -> int:
    """SIGKILL the one live `kind` service of the job (a replacement when not_pid is given); returns its pid."""
    def live() -> list[int]:
        return [p for p in service_pids(kind, job.config_path) if p != not_pid]

    pids = job.wait_until(live, f"a {kind} process")
    assert isinstance(pids, list) and len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def celery_worker_pids(job_id: str) -> list[int]:
    """Live processes (worker and pool children) of the job's launched Celery worker."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if b"jetroll.functions.celery_app" in args and f"jetroll-{job_id}-".encode() in args:
            pids.append(int(entry.name))
    return pids


def scored_events(redis_url: str, job_id: str) -> list[AnyEvent]:
    """Every event the job's `traj:scored` holds (tests hold the stream untrimmed with `hold_streams`)."""
    client = redis.Redis.from_url(redis_url)
    try:
        return [decode(fields[b"e"]) for _, fields in client.xrange(f"jetroll:{job_id}:traj:scored")]
    finally:
        client.close()


def hold_streams(redis_url: str, job_id: str, *streams: str) -> None:
    """Give each of the job's `streams` an `audit` consumer group that never reads, before the job starts: its
    consumers trim only past what every group has acked, so the stream keeps every entry for the test to read."""
    client = redis.Redis.from_url(redis_url)
    try:
        for stream in streams:
            client.xgroup_create(f"jetroll:{job_id}:{stream}", "audit", id="0", mkstream=True)
    finally:
        client.close()


def read_ledger(redis_url: str, job_id: str) -> tuple[int, dict[str, Outcome], LedgerTotals]:
    """The job's admission counter, the outcomes its ledger keeps, and its totals."""

    async def read() -> tuple[int, dict[str, Outcome], LedgerTotals]:
        bus = RedisBus(redis_url, job_id)
        try:
            ledger = Ledger(bus)
            num_admitted = int(await bus.redis.get(bus.key("num_admitted")) or 0)
            return num_admitted, await ledger.outcomes(), await ledger.totals()
        finally:
            await bus.close()

    return asyncio.run(read())


def audit_ledger(redis_url: str, job_id: str, max_steps: int, groups_per_step: int, group_size: int,
                 keep_groups: int = RedisConfig().ledger_keep_groups) -> LedgerTotals:
    """Every admitted group recorded exactly once, trained (with all its samples) or dropped with a reason; none lost.
    The ledger keeps the newest outcomes and counts every group in its totals."""
    num_admitted, outcomes, totals = read_ledger(redis_url, job_id)
    # the prefix passes only recorded groups, so every admitted group reached the trainer's ledger
    assert totals.prefix == num_admitted + 1, f"admitted {num_admitted}, but group {totals.prefix} is not recorded"
    # and each was counted once: a second record of a group (a retrained copy) would count twice
    assert sum(totals.num_groups.values()) == num_admitted, (totals, num_admitted)
    assert totals.num_groups.get("trained") == max_steps * groups_per_step, totals
    assert totals.num_samples["trained"] == max_steps * groups_per_step * group_size, totals
    assert totals.max_step == max_steps, totals
    for status in totals.num_groups:
        assert status == "trained" or status.startswith("dropped:") and len(status) > len("dropped:"), totals
    # the newest keep_groups outcomes are kept (none above the prefix once the job is over), older ones folded
    kept = {group_id(i) for i in range(max(1, totals.prefix - keep_groups), totals.prefix)}
    assert set(outcomes) == kept, sorted(set(outcomes) ^ kept)
    steps = Counter(o.step for o in outcomes.values() if o.status == "trained")
    for group, outcome in outcomes.items():
        assert outcome.status in totals.num_groups, (group, outcome)
        if outcome.status == "trained":
            assert outcome.num_samples == group_size and 1 <= outcome.step <= max_steps, (group, outcome)
    assert all(n <= groups_per_step for n in steps.values()), steps
    return totals


def check_summary(job: Job, max_steps: int, *, dead_letters: bool = False) -> dict:
    """The summary of a finished job; unless bad events were sent on purpose (`dead_letters`), none of its own
    events went to the dlq: a check that refused a real event would stall or thin the job."""
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["steps"] == max_steps
    assert dead_letters or summary["dead_letters"] == {}, summary["dead_letters"]
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["rollout_tokens_per_s"] > 0
    assert math.isfinite(summary["mismatch_mean_abs_logprob"])
    assert 0.0 < summary["mismatch_coverage"] <= 1.0
    rows = job.metrics()
    assert [int(r["step"]) for r in rows] == list(range(1, max_steps + 1))
    assert all(r["entropy"] > 0 for r in rows), [r.get("entropy") for r in rows]  # nats, of pi_prox per policy token
    assert (job.run_dir / "curves.png").stat().st_size > 0
    # every key of the job is one that retention bounds
    memory = summary["redis_memory"]
    assert set(memory["keys"]) <= JOB_KEYS, sorted(set(memory["keys"]) - JOB_KEYS)
    assert 0 < memory["job_keys_bytes"] < memory["used_memory_bytes"]
    weights = job.run_dir / "store" / job.job_id / "weights"
    latest = int((weights / "LATEST").read_text().strip())
    assert latest == max_steps
    assert (weights / f"v{latest:08d}" / "manifest.json").is_file()
    return summary
