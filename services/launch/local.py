"""The local launcher: a private redis-server and every service as supervised child processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from jetroll.services.launch.celery_worker import start_worker_process
from jetroll.services.launch.procs import Lives, stop_processes, supervise
from jetroll.services.launch.redis_server import RedisServer
from jetroll.services.reward.backends import needs_celery_worker
from jetroll.shared.config.dataset import DatasetTaskConfig
from jetroll.shared.config.job import JobConfig, validate_config
from jetroll.shared.errors import JOB_FAILED_EXIT
from jetroll.shared.tasks.registry import get_task

POLL_S = 0.5


@dataclass(slots=True)
class Service:
    lives: Lives  # its name is also the base of the consumer name
    kind: str  # controller | rollout | reward | trainer | celery (a reward worker) | redis (the job's own server)
    pool: str | None = None  # rollout: the pool it serves
    process: subprocess.Popen | None = None
    log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.lives.name


class Launcher:
    def __init__(self, config: JobConfig, run_dir: Path, redis_url: str, is_console: bool = True,
                 redis_server: RedisServer | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.is_console = is_console  # False: the controller's progress goes to its log too (benchmarks)
        self.redis_url = redis_url
        self.redis_server = redis_server  # the job's own server, restarted like a service when it dies
        self.config_path = run_dir / "config.json"
        self.config_path.write_text(json.dumps(config.model_dump(mode="json"), indent=2))
        (run_dir / "logs").mkdir(exist_ok=True)
        def service(name: str, kind: str, pool: str | None = None) -> Service:
            return Service(Lives(name, config.launch.max_restarts), kind, pool)

        rollouts = [service(f"rollout-{pool.name}-{i}", "rollout", pool.name)
                    for pool in config.rollout.pools for i in range(pool.num_workers)]
        self.services = [service("trainer", "trainer"), service("reward", "reward"), *rollouts,
                         service("controller", "controller")]
        if needs_celery_worker(config.reward, [task.name for task in config.tasks]):
            self.services.insert(0, service("celery-worker", "celery"))
        if redis_server is not None:
            self.services.insert(0, service("redis", "redis"))

    def start(self, service: Service, consumer: str) -> None:
        if service.log is None:
            service.log = (self.run_dir / "logs" / f"{service.name}.log").open("ab")
        if service.kind == "celery":
            reward = self.config.reward
            node = f"jetroll-{self.config.job_id}-{consumer}@localhost"
            service.process = start_worker_process(reward, reward.celery_broker_url or self.redis_url, node,
                                                   service.log)
            return
        cmd = [sys.executable, "-m", "jetroll.services.cli", service.kind, "--config", str(self.config_path),
               "--redis-url", self.redis_url, "--consumer", consumer, "--run-dir", str(self.run_dir)]
        if service.pool is not None:
            cmd += ["--pool", service.pool]
        # the controller owns the console (progress view); the others log to files
        out = None if service.kind == "controller" and self.is_console else service.log
        # own session: a Ctrl-C reaches only the launcher, which then stops every child in order
        service.process = subprocess.Popen(cmd, stdout=out, stderr=service.log, start_new_session=True)

    def supervise(self) -> int:
        """Run until the controller finishes (0) or a service dies more than max_restarts times (1)."""
        return asyncio.run(self._supervise_all())

    async def _supervise_all(self) -> int:
        tasks = {asyncio.create_task(self._supervise(service)): service for service in self.services}
        try:
            while True:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    service, code = tasks.pop(task), task.result()
                    if service.kind == "controller" or code != 0:
                        return 0 if service.kind == "controller" and code == 0 else 1
        finally:  # the processes themselves are stopped by `stop`, in order
            for task in tasks:
                task.cancel()

    async def _supervise(self, service: Service) -> int | None:
        def on_death(consumer: str, code: int, is_restarted: bool) -> None:
            lives = service.lives
            if is_restarted:
                print(f"jetroll: service {service.name} died (exit {code}); restart "
                      f"{lives.num_restarts}/{lives.max_restarts}", file=sys.stderr)
            elif code == JOB_FAILED_EXIT:
                print(f"jetroll: service {service.name} failed the job: {self._failure(service)}", file=sys.stderr)
            else:
                print(f"jetroll: service {service.name} died (exit {code}) after {lives.num_restarts} "
                      f"restarts; see {self.run_dir / 'logs' / (service.name + '.log')}", file=sys.stderr)

        # the controller and the trainer end by finishing their job; the other services serve until stopped
        return await supervise(service.lives, lambda consumer: self._life(service, consumer), on_death,
                               may_finish=service.kind in ("controller", "trainer"))

    def _failure(self, service: Service) -> str:
        """The reason a service gave for failing the job: the last `job failed:` line of its log."""
        path = self.run_dir / "logs" / f"{service.name}.log"
        lines = [line for line in path.read_text(errors="replace").splitlines() if "job failed: " in line]
        return lines[-1].split("job failed: ", 1)[1] if lines else f"see {path}"

    async def _life(self, service: Service, consumer: str) -> int:
        if service.kind == "redis":
            return await self._redis_life()
        self.start(service, consumer)
        assert service.process is not None
        while (code := service.process.poll()) is None:
            await asyncio.sleep(POLL_S)
        if service.kind == "celery":  # its pool children outlive the main process
            stop_processes([service.process], groups=True)
        return code

    async def _redis_life(self) -> int:
        """The first life is the server `run_job` started; each later one restarts it from its append-only file."""
        server = self.redis_server
        assert server is not None
        if not server.is_running:
            await asyncio.to_thread(server.restart)
        while (code := server.returncode) is None:
            await asyncio.sleep(POLL_S)
        return code

    def stop(self) -> None:
        started = [s for s in self.services if s.process is not None]
        stop_processes([s.process for s in started if s.kind != "celery"])
        stop_processes([s.process for s in started if s.kind == "celery"], groups=True)
        for service in self.services:
            if service.log:
                service.log.close()


def resolve_config(config: JobConfig, run_dir: Path) -> JobConfig:
    """The config every service of a job reads: its datasets read and checked, the base model built or found
    (model.path), and the store root (or the S3 store's cache) and dataset paths made absolute, `<run_dir>/store`
    by default. `jetroll run` and the watch-mode controller both resolve a job this way."""
    from jetroll.shared.warm_start import ensure_base_model

    check_datasets(config)
    model_path = ensure_base_model(config.model)
    store_root = config.store.root or str(run_dir / "store")
    tree = config.model_dump(mode="json")
    tree["model"]["path"] = str(Path(model_path).resolve())
    tree["model"]["init"] = "pretrained"  # what the services load, whatever built it
    tree["model"]["tokenizer"] = None  # the built model holds it
    tree["store"]["root"] = str(Path(store_root).resolve())
    for task in tree["tasks"]:
        for key in ("path", "heldout_path"):
            if task.get(key):
                task[key] = str(Path(task[key]).expanduser().resolve())
    return validate_config(tree)


def check_datasets(config: JobConfig) -> None:
    """Read every dataset task's files before anything starts: a missing file or an empty split fails here with
    one line (DatasetError), and the rows skipped as bad are counted."""
    for entry in config.tasks:
        if isinstance(entry, DatasetTaskConfig):
            rows = get_task(entry.name).rows
            print(f"jetroll: dataset task {entry.name}: {len(rows.train)} training, {len(rows.probe)} probe and "
                  f"{len(rows.heldout)} held-out rows from {len(rows.files)} file(s); {len(rows.bad)} bad rows "
                  "skipped" + (f", {rows.heldout_overlap} training rows dropped as held-out duplicates"
                               if rows.heldout_overlap else ""), file=sys.stderr)
            if len(rows.heldout) < config.eval.num_problems:
                print(f"jetroll: dataset task {entry.name}: eval.num_problems is {config.eval.num_problems}, but it "
                      f"has {len(rows.heldout)} held-out rows: the eval scores those", file=sys.stderr)


def run_job(config: JobConfig, run_dir: Path | None = None, redis_url: str | None = None) -> int:
    """`jetroll run`: build/find the base model, start Redis unless given (persisting under `<run-dir>/redis`), run
    the services to the end."""
    run_dir = (run_dir or Path("runs") / config.job_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config = resolve_config(config, run_dir)

    server = None
    redis_url = redis_url or config.redis.url
    if redis_url is None:
        server = RedisServer(data_dir=run_dir / "redis").start()
        redis_url = server.url
    launcher = Launcher(config, run_dir, redis_url, redis_server=server)
    print(f"jetroll: job {config.job_id} in {run_dir} (redis {redis_url}, pid {os.getpid()})", file=sys.stderr)
    try:
        code = launcher.supervise()
    except KeyboardInterrupt:
        print("jetroll: interrupted; stopping services", file=sys.stderr)
        code = 130
    finally:
        launcher.stop()
        if server is not None:
            server.stop()
    if code == 0:
        print(f"jetroll: done; see {run_dir / 'summary.json'}", file=sys.stderr)
    return code
