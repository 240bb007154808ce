"""`jetroll bench chaos`: the default async job under a seeded schedule of faults, then an audit of its work.

The job runs as `jetroll run` runs it (its own Redis, every service a process), with its weight store on S3 behind a
TCP proxy. The schedule, drawn from the seed, SIGKILLs every service (the trainer twice), SIGKILLs the job's Redis
(the launcher restarts it from its append-only file) and cuts S3 for `outage_s`, each at a seeded step and only once
the fault before it has recovered: the job has trained max_staleness + 2 steps past the step the fault hit, more
than were in flight before it.

The audit counts from what survived, not from what the services say: the store's step records (one per surviving
step, create-only) give each group trained once or twice, the job's summary the groups admitted and dropped with a
reason; lost = admitted - trained - dropped. A finished run leaves `row.json` and is not run again, so the bench
resumes across sessions; an interrupted one starts over (its S3 store lived in memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from jetroll.bench.processes import processes, stop_like_ctrl_c
from jetroll.bench.resume import claim_run_dir
from jetroll.bench.store import moto_server
from jetroll.bench.tcp_proxy import TcpProxy
from jetroll.shared.config.job import JobConfig, load_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.store import setup_store

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "arithmetic.yaml"
DEFAULT_RUN_DIR = Path("~/.cache/jetroll/bench/chaos")
FAULTS = ("trainer", "trainer", "rollout", "reward", "controller", "redis", "s3")
BUCKET = "jetroll-chaos"
PREFIX = "runs"  # the store adds the job id below it
MOTO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "chaos", "AWS_SECRET_ACCESS_KEY": "chaos", "AWS_DEFAULT_REGION": "us-east-1"}
FAULT_TIMEOUT_S = 600.0  # a job that trains no step for this long, fault or not, fails the run
T = TypeVar("T")


@dataclass
class Fault:
    kind: str  # a service to SIGKILL, "redis" (SIGKILL the job's Redis) or "s3" (cut the store for outage_s)
    step: int  # fired once the job has trained this many steps
    fired_at_s: float | None = None  # since the job started
    fired_at_step: int | None = None
    recovery_s: float | None = None  # from the fault until the job trained max_staleness + 2 steps past it


def schedule(seed: int, max_steps: int) -> list[Fault]:
    """Every fault once (the trainer twice), in a seeded order, each at a seeded step of its own slot of steps 5% to
    90% of the job: the slots keep faults apart, and leave room to recover from the last one."""
    rng = random.Random(seed)
    low, high = max(1, max_steps // 20), max_steps * 9 // 10
    width = (high - low) // len(FAULTS)
    if width < 1:
        raise ConfigError(f"bench chaos: {max_steps} steps leave no room for {len(FAULTS)} faults; use more steps")
    kinds = list(FAULTS)
    rng.shuffle(kinds)
    return [Fault(kind, low + i * width + rng.randrange(width)) for i, kind in enumerate(kinds)]


def run_chaos_bench(seed: int = 0, run_dir: Path | None = None, overrides: list[str] = (),
                    max_steps: int | None = None, outage_s: float = 30.0,
                    s3_endpoint: str | None = None, fault_free: int = 0) -> dict[str, Any]:
    """The faulted run of `seed`, then `fault_free` runs of the same job with no fault: the accuracy a faulted run is
    held to is their mean (within 3 points) when it misses the learning matrix's minimum. Each run resumes alone."""
    extra = [*overrides, *([f"trainer.max_steps={max_steps}"] if max_steps else [])]
    config = load_config(CONFIG, extra)  # a bad override fails here, before anything starts
    if config.store.type != "local" or config.staleness.mode != "async":
        raise ConfigError("bench chaos runs the async job and puts its store on S3 itself; drop the store and "
                          "staleness overrides")
    root = Path(run_dir or DEFAULT_RUN_DIR).expanduser().resolve()
    rows = []
    for out, with_faults in ((root / f"seed{seed}", True),
                             *((root / f"seed{seed}-fault-free{i}", False) for i in range(fault_free))):
        if not (out / "row.json").exists():
            claim_run_dir(root, {"config": CONFIG.read_text(), "overrides": list(extra), "outage_s": outage_s},
                          "chaos")
            run_one(config, seed, out, extra, outage_s, s3_endpoint, with_faults)
        rows.append(json.loads((out / "row.json").read_text()))
    result = {"config": {"config": str(CONFIG), "overrides": extra, "seed": seed, "outage_s": outage_s,
                         "run_dir": str(root)}, "rows": rows[:1], "fault_free_rows": rows[1:]}
    if fault_free:
        mean = sum(r["accuracy_after"] for r in rows[1:]) / fault_free
        result["summary"] = {"fault_free_mean": mean, "faulted_minus_mean": rows[0]["accuracy_after"] - mean}
    return result


def run_one(config: JobConfig, seed: int, out: Path, overrides: list[str], outage_s: float,
            s3_endpoint: str | None, with_faults: bool = True) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    faults = schedule(seed, config.trainer.max_steps) if with_faults else []
    job_id = f"chaos-s{seed}-{os.urandom(3).hex()}"
    with _s3(s3_endpoint) as (endpoint, env):
        target = urlsplit(endpoint)
        proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 80).start()
        command = [sys.executable, "-m", "jetroll.services.cli", "run", str(CONFIG), "--run-dir", str(out / "run"),
                   *(arg for item in [*overrides, f"seed={seed}", f"job_id={job_id}",
                                      f"store.uri=s3://{BUCKET}/{PREFIX}", f"store.endpoint_url={proxy.url}"]
                     for arg in ("--set", item))]
        print(f"bench chaos: seed {seed}, {len(faults)} faults: "
              + ", ".join(f"{f.kind}@{f.step}" for f in faults), file=sys.stderr, flush=True)
        started = time.perf_counter()
        with open(out / "job.log", "wb") as log:
            job = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
            try:
                code = _inject(job, faults, out / "run", config.staleness.max_staleness + 2, proxy, outage_s,
                               started)
            finally:
                if job.poll() is None:  # interrupted, or a fault that never recovered
                    stop_like_ctrl_c(job)
                proxy.cut()
        wall_s = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"bench chaos: the job failed (exit {code}); see {out / 'job.log'}")
        direct = config.model_copy(update={"store": config.store.model_copy(update={
            "type": "s3", "uri": f"s3://{BUCKET}/{PREFIX}", "endpoint_url": endpoint})})
        row = {"seed": seed, "faults": [asdict(f) for f in faults], "wall_s": round(wall_s, 1),
               **audit(direct, job_id, out / "run")}
    (out / "row.json").write_text(json.dumps(row, indent=2))
    print(f"bench chaos: seed {seed}{'' if with_faults else ', no faults'}: trained twice {row['trained_twice']}, "
          f"lost {row['lost']}, final "
          f"{row['accuracy_after']:.1%}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _s3(endpoint: str | None) -> Iterator[tuple[str, dict[str, str]]]:
    """The S3 endpoint the job's store uses and the environment its clients need: the one given, or a moto server
    started here (moto keeps the objects in memory, for this run only)."""
    if endpoint is not None:
        _make_bucket(endpoint, {})
        yield endpoint, {}
        return
    try:
        import moto.server  # noqa: F401 - the server runs as a subprocess; this checks it is installed
    except ImportError:
        raise ConfigError("bench chaos needs an S3 endpoint for its store: pass --s3-endpoint URL, or install moto "
                          "(pip install 'moto[server]', in the dev extra)") from None
    saved = {name: os.environ.get(name) for name in MOTO_CREDENTIALS}
    os.environ.update(MOTO_CREDENTIALS)  # for the audit's own store client
    try:
        with moto_server() as endpoint:
            _make_bucket(endpoint, MOTO_CREDENTIALS)
            yield endpoint, MOTO_CREDENTIALS
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _make_bucket(endpoint: str, credentials: dict[str, str]) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name=credentials.get("AWS_DEFAULT_REGION"),
                          aws_access_key_id=credentials.get("AWS_ACCESS_KEY_ID"),
                          aws_secret_access_key=credentials.get("AWS_SECRET_ACCESS_KEY"))
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=BUCKET)


def _inject(job: subprocess.Popen[bytes], faults: list[Fault], run_dir: Path, recovered_after: int,
            proxy: TcpProxy, outage_s: float, started: float) -> int:
    """Fire each fault at its step, once the one before it has recovered; then wait for the job's exit code."""
    def wait_for(predicate: Callable[[], T | None], what: str) -> T:
        """Poll until `predicate` holds; fail once the job trains no step for FAULT_TIMEOUT_S (a stall), however
        slowly the machine runs the steps between faults."""
        step, deadline = _step(run_dir), time.monotonic() + FAULT_TIMEOUT_S
        while (value := predicate()) is None or value is False:
            if job.poll() is not None:
                raise RuntimeError(f"bench chaos: the job exited ({job.returncode}) waiting for {what}")
            if (now := _step(run_dir)) > step:
                step, deadline = now, time.monotonic() + FAULT_TIMEOUT_S
            elif time.monotonic() > deadline:
                raise RuntimeError(f"bench chaos: the job trained no step in {FAULT_TIMEOUT_S:.0f} s (at step {step}) "
                                   f"waiting for {what}")
            time.sleep(0.2)
        return value

    for fault in faults:
        wait_for(lambda f=fault: _step(run_dir) >= f.step, f"step {fault.step}")
        fired = time.perf_counter()
        fault.fired_at_s, fault.fired_at_step = round(fired - started, 1), _step(run_dir)
        print(f"bench chaos: {fault.kind} at step {fault.fired_at_step}", file=sys.stderr, flush=True)
        if fault.kind == "s3":
            proxy.cut()
            time.sleep(outage_s)
            proxy.restore()
        else:
            pid = wait_for(lambda f=fault: _child(job.pid, f.kind), f"a live {fault.kind}")
            os.kill(pid, signal.SIGKILL)
        target = min(fault.fired_at_step + recovered_after, _max_steps(run_dir))
        wait_for(lambda n=target: _step(run_dir) >= n, f"recovery from the {fault.kind} fault")
        fault.recovery_s = round(time.perf_counter() - fired, 1)
    return job.wait()


def _step(run_dir: Path) -> int:
    """The newest step in metrics.jsonl (read from its tail: the file grows to megabytes)."""
    path = run_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            return int(json.loads(line)["step"])
    return 0


def _max_steps(run_dir: Path) -> int:
    return int(json.loads((run_dir / "config.json").read_text())["trainer"]["max_steps"])


def _child(parent: int, kind: str) -> int | None:
    """The pid of the launcher's live child of `kind`: a service (`jetroll.services.cli <kind>`) or the Redis."""
    return next((p.pid for p in processes().values() if p.parent == parent and p.state != "Z" and p.service == kind),
                None)


def audit(config: JobConfig, job_id: str, run_dir: Path) -> dict[str, Any]:
    """Admitted, trained once, trained twice, dropped (by reason) and lost, from the store's step records and the
    summary; and the summary's accuracies."""
    summary = json.loads((run_dir / "summary.json").read_text())
    store = setup_store(config.store, job_id, run_dir)
    records = asyncio.run(store.step_records())
    times_trained = Counter(group for record in records for group in record.groups)
    dropped = summary["dropped_by_status"]
    admitted = summary["groups_admitted"]
    return {"steps": summary["steps"], "steps_recorded": len(records), "admitted": admitted,
            "trained_once": sum(n == 1 for n in times_trained.values()),
            "trained_twice": sum(n > 1 for n in times_trained.values()),
            "dropped": sum(dropped.values()), "dropped_by_status": dropped,
            "lost": admitted - len(times_trained) - sum(dropped.values()),
            "ledger_trained": sum(summary["groups_trained_by_task"].values()),
            "accuracy_before": summary["accuracy_before"], "accuracy_after": summary["accuracy_after"],
            "job_wall_s": summary["wall_time_s"]}


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for row in result["rows"]:
        faults = Table(title=f"chaos: seed {row['seed']}, {row['steps']} steps, {row['wall_s'] / 60:.1f} min")
        for column in ("fault", "at step", "at s", "recovery s"):
            faults.add_column(column, justify="right")
        for f in row["faults"]:
            faults.add_row(f["kind"], str(f["fired_at_step"]), f"{f['fired_at_s']:.0f}", f"{f['recovery_s']:.1f}")
        console.print(faults)
        console.print(f"admitted {row['admitted']}, trained once {row['trained_once']}, dropped {row['dropped']} "
                      f"{row['dropped_by_status']}, trained twice {row['trained_twice']}, lost {row['lost']}; "
                      f"held-out accuracy {row['accuracy_before']:.1%} -> {row['accuracy_after']:.1%}")
    for row in result["fault_free_rows"]:
        console.print(f"fault-free run: {row['wall_s'] / 60:.1f} min, trained twice {row['trained_twice']}, lost "
                      f"{row['lost']}; held-out accuracy {row['accuracy_before']:.1%} -> {row['accuracy_after']:.1%}")
    if "summary" in result:
        console.print(f"fault-free mean {result['summary']['fault_free_mean']:.1%}; the faulted run is "
                      f"{result['summary']['faulted_minus_mean'] * 100:+.2f} points from it")
