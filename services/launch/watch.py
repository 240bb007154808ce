"""Watch mode: the controller runs submitted jobs one at a time; the other services join and leave them.

The controller reads `jetroll:jobs` in a consumer group, resolves each job as `jetroll run` does, marks it
`running`, announces the resolved config on `jetroll:jobs:active`, runs the controller to the end, marks it `done`
(with the summary) or `failed` (with the error), and acks. Services tail the announcements from the start and
join each job whose status is `running`; they leave when it turns `done` or `failed`.

Each job's service runs as its own process, exactly as the local launcher starts it (`jetroll <service> --config`):
a job's memory (and GPU memory) goes with it, a crash stays in that job, and a service that does not stop when its
job ends is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from jetroll.services.launch.jobs import FINAL_STATUSES, SUMMARY_FIELDS, check_job_id
from jetroll.services.launch.procs import Lives, stop_process, supervise
from jetroll.shared.config.job import JobConfig, config_to_json, config_tree, validate_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.protocol.bus import FIELD
from jetroll.shared.protocol.events import EventDecodeError, JobEvent, decode
from jetroll.shared.protocol.jobs import JobBoard, JobQueue
from jetroll.shared.protocol.topology import ACTIVE, JOBS, RESERVED_JOB_IDS

log = logging.getLogger("jetroll.watch")

POLL_S = 1.0
STOP_TIMEOUT_S = 10.0
HEARTBEAT_ENV = "JETROLL_HEARTBEAT_FILE"
# (service, resolved config file, run dir, consumer) -> the argv of that service's process for one job
ServiceArgv = Callable[[str, Path, Path, str], list[str]]


def service_argv(redis_url: str, extra: Sequence[str] = ()) -> ServiceArgv:
    """`jetroll <service> --config ...`, as the local launcher starts a service."""

    def argv(name: str, config_path: Path, run_dir: Path, consumer: str) -> list[str]:
        return [sys.executable, "-m", "jetroll.services.cli", name, "--config", str(config_path),
                "--redis-url", redis_url, "--consumer", consumer, "--run-dir", str(run_dir), *extra]

    return argv


def default_consumer(name: str) -> str:
    """Unique per replica, so `--scale rollout=N` gives N consumers."""
    return f"{name}-{socket.gethostname()}-{os.getpid()}"


class JobRejected(Exception):
    """A submission that cannot run: it goes to the jobs dlq and, when its job_id is known, is marked failed."""

    def __init__(self, reason: str, job_id: str | None) -> None:
        super().__init__(reason)
        self.reason, self.job_id = reason, job_id


async def run_while_running(argv: list[str], board: JobBoard, job_id: str, *, poll_s: float = POLL_S,
                            stop_timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """Run one process while the job's status stays `running`; its exit code, or None when the job ended first
    (done, failed or gone). A process still alive then, or when the watcher stops, gets SIGTERM, then SIGKILL."""
    env = {k: v for k, v in os.environ.items() if k != HEARTBEAT_ENV}  # the heartbeat is the watcher's
    process = await asyncio.create_subprocess_exec(*argv, env=env)
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(process.wait(), poll_s)
            record = await board.get(job_id)
            if record is None or record.get("status") != "running":
                return None
    finally:
        if await stop_process(process, stop_timeout_s):
            log.warning("pid %d ignored SIGTERM for %.0f s; killed it", process.pid, stop_timeout_s)


async def serve_job(name: str, consumer: str, config: JobConfig, config_path: Path, run_dir: Path,
                    argv: ServiceArgv, board: JobBoard, *, poll_s: float = POLL_S,
                    stop_timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """Run the service for the job, restarting it up to `launch.max_restarts` times while the job runs, as the local
    launcher does (each restart a new consumer, which reclaims the dead one's entries). Returns 0 when it finished,
    None when the job ended first, else the last exit code."""
    lives = Lives(consumer, config.launch.max_restarts)

    def on_death(dead: str, code: int, is_restarted: bool) -> None:
        what = f"restart {lives.num_restarts}/{lives.max_restarts}" if is_restarted else "no restart left"
        log.error("%s exited with %d in job %s (%s)", dead, code, config.job_id, what)

    return await supervise(lives, lambda life: run_while_running(argv(name, config_path, run_dir, life), board,
                                                                 config.job_id, poll_s=poll_s,
                                                                 stop_timeout_s=stop_timeout_s), on_death)


async def watch_jobs(redis_url: str, runs_dir: Path, consumer: str = JOBS.group, argv: ServiceArgv | None = None,
                     *, poll_s: float = POLL_S, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
    """`jetroll controller --watch`: run every job on `jetroll:jobs` in order, one at a time, forever. A bad
    submission is dead-lettered and marked failed; a failing job is marked failed; neither stops the watcher.
    This consumer's unacked job (the watcher restarted mid-job) runs first: the job resumes where it was."""
    argv = argv or service_argv(redis_url)
    async with JobQueue(redis_url) as queue:
        await queue.join()
        log.info("controller %s watching %s", consumer, JOBS.name)
        pending = True  # this consumer's unacked entries first, then new ones
        while True:
            entries = await queue.read(consumer, pending=pending, block_ms=int(poll_s * 1000))
            if not entries:
                pending = False
                continue
            for entry_id, payload in entries:
                try:
                    event, config = _parse_job(payload)
                except JobRejected as exc:
                    await _reject(queue, entry_id, payload, exc)
                else:
                    await _run_job(queue, event, config, (runs_dir / config.job_id).resolve(), consumer, argv,
                                   poll_s, stop_timeout_s)
                await queue.ack(entry_id)


def _parse_job(payload: bytes | None) -> tuple[JobEvent, JobConfig]:
    if payload is None:
        raise JobRejected(f"missing field {FIELD.decode()!r}", None)
    try:
        event = decode(payload)
    except EventDecodeError as exc:
        raise JobRejected(f"undecodable event: {exc}", _peek_job_id(payload)) from None
    if not isinstance(event, JobEvent):
        raise JobRejected(f"expected a job event, got a {type(event).__struct_config__.tag} event", None)
    job_id = None if event.job_id in RESERVED_JOB_IDS else event.job_id
    try:
        config = validate_config({"job_id": event.job_id, **event.config})
        check_job_id(config.job_id)
    except ConfigError as exc:
        raise JobRejected(str(exc), job_id) from None
    if config.job_id != event.job_id:
        raise JobRejected(f"config job_id {config.job_id!r} differs from the event's {event.job_id!r}", job_id)
    return event, config


def _peek_job_id(payload: bytes) -> str | None:
    """The job_id of an event that does not decode as one, if a msgpack map holds a usable one."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    job_id = raw.get("job_id") if isinstance(raw, dict) else None
    return job_id if isinstance(job_id, str) and job_id and job_id not in RESERVED_JOB_IDS else None


async def _reject(queue: JobQueue, entry_id: str, payload: bytes | None, exc: JobRejected) -> None:
    log.warning("job entry %s rejected: %s", entry_id, exc.reason)
    await queue.dead_letter(entry_id, payload, exc.reason)
    if exc.job_id is not None:  # never clobber a job of that id that runs or ran
        await queue.board.update(exc.job_id, expect=(None, "queued"), status="failed", error=exc.reason,
                           finished_at=time.time())


async def _run_job(queue: JobQueue, event: JobEvent, config: JobConfig, run_dir: Path, consumer: str,
                   argv: ServiceArgv, poll_s: float, stop_timeout_s: float) -> None:
    from jetroll.services.launch.run import resolve_config

    board = queue.board
    job_id = config.job_id
    previous = await board.get(job_id) or {}
    if previous.get("status") in FINAL_STATUSES and previous.get("submitted_at") == event.submitted_at:
        log.info("job %s already %s (the watcher stopped before its ack)", job_id, previous["status"])
        return
    is_resumed = previous.get("status") == "running"
    await board.update(job_id, status="running", submitted_at=previous.get("submitted_at", event.submitted_at),
                       started_at=previous["started_at"] if is_resumed else time.time(), run_dir=str(run_dir))
    log.info("job %s %s in %s", job_id, "resumed" if is_resumed else "started", run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = await asyncio.to_thread(resolve_config, config, run_dir)
        config_path = run_dir / "config.json"  # as the local launcher writes it
        config_path.write_text(config_to_json(resolved))
        announcement = JobEvent(job_id=job_id, config=config_tree(resolved), submitted_at=event.submitted_at)
        await queue.announce(announcement)
        code = await serve_job("controller", consumer, resolved, config_path, run_dir, argv, board, poll_s=poll_s,
                               stop_timeout_s=stop_timeout_s)
        if code is None:
            log.warning("job %s ended before its controller did: %s", job_id,
                        (await board.get(job_id) or {}).get("error"))
            return
        if code != 0:
            raise RuntimeError(f"the controller exited with {code} after {resolved.launch.max_restarts} restarts; "
                               f"see its log")
        summary = json.loads((run_dir / "summary.json").read_text())
    except Exception as exc:  # a failed job is a status; the watcher goes on with the next one
        log.error("job %s failed: %s", job_id, exc)
        await board.update(job_id, expect=("running",), status="failed", finished_at=time.time(),
                           error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        return
    await board.update(job_id, expect=("running",), status="done", finished_at=time.time(),
                       **{name: summary[name] for name in SUMMARY_FIELDS if name in summary})
    log.info("job %s done", job_id)


async def watch_service(name: str, redis_url: str, runs_dir: Path, consumer: str, argv: ServiceArgv | None = None,
                        *, poll_s: float = POLL_S, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
    """`jetroll rollout|reward|trainer --watch`: join every announced job while it runs (one already running at
    start too), serve it until it ends (the trainer: until its last step), then wait for the next one. A service
    that keeps failing fails the job, with a message naming it."""
    argv = argv or service_argv(redis_url)
    served: set[str] = set()
    last_id = "0-0"
    log.info("%s %s waiting for jobs on %s", name, consumer, ACTIVE)
    async with JobQueue(redis_url) as queue:
        while True:
            for entry_id, payload in await queue.announcements(last_id, block_ms=int(poll_s * 1000)):
                last_id = entry_id
                config = _announced(entry_id, payload)
                if config is None or config.job_id in served:
                    continue
                record = await queue.board.get(config.job_id)
                if record is None or record.get("status") != "running":
                    continue
                served.add(config.job_id)
                await _serve(name, consumer, config, (runs_dir / config.job_id).resolve(), argv, queue.board, poll_s,
                             stop_timeout_s)


def _announced(entry_id: str, payload: bytes | None) -> JobConfig | None:
    try:
        if payload is None:
            raise EventDecodeError(f"missing field {FIELD.decode()!r}")
        event = decode(payload)
        if not isinstance(event, JobEvent):
            raise EventDecodeError(f"expected a job event, got a {type(event).__struct_config__.tag} event")
        return validate_config(event.config)
    except (EventDecodeError, ConfigError) as exc:
        log.warning("skipping announcement %s on %s: %s", entry_id, ACTIVE, exc)
        return None


async def _serve(name: str, consumer: str, config: JobConfig, run_dir: Path, argv: ServiceArgv, board: JobBoard,
                 poll_s: float, stop_timeout_s: float) -> None:
    job_id = config.job_id
    log.info("%s joins job %s", consumer, job_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    # a private copy of the resolved config: the run dir need not be shared with the controller
    fd, path = tempfile.mkstemp(prefix=f"jetroll-{job_id}-{name}-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(config_to_json(config))
        code = await serve_job(name, consumer, config, Path(path), run_dir, argv, board, poll_s=poll_s,
                               stop_timeout_s=stop_timeout_s)
    finally:
        Path(path).unlink(missing_ok=True)
    if code not in (None, 0):
        error = f"service {name} ({consumer}) exited with {code} after {config.launch.max_restarts} restarts"
        log.error("%s; failing job %s", error, job_id)
        await board.update(job_id, expect=("running",), status="failed", finished_at=time.time(), error=error)
    log.info("%s leaves job %s", consumer, job_id)


async def heartbeat(path: Path, every_s: float = 5.0) -> None:
    """Touch `path` every few seconds while the event loop runs: a container healthcheck reads its age."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        path.touch()
        await asyncio.sleep(every_s)
