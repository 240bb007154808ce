"""The local launcher: every service of a job as a supervised child process, and the job's own redis-server (when
`run` started one) restarted like a service from its append-only file."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from jetroll.services.launch.celery_worker import start_worker_process
from jetroll.services.launch.procs import Lives, stop_processes, supervise
from jetroll.services.launch.redis_server import RedisServer
from jetroll.services.reward.backends import needs_celery_worker
from jetroll.shared.config.job import JobConfig, config_to_json
from jetroll.shared.errors import JOB_FAILED_EXIT

POLL_S = 0.5


@dataclass(slots=True)
class Service:
    lives: Lives  # its name is also the base of the consumer name
    kind: str  # controller | rollout | reward | trainer | env | celery (a reward worker) | redis (its own server)
    pool: str | None = None  # rollout: the pool it serves
    process: subprocess.Popen | None = None
    log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.lives.name


class Launcher:
    """Every service of a job as a supervised child process (`jetroll <service> --config`)."""

    where = "local"

    def __init__(self, config: JobConfig, run_dir: Path, redis_url: str, is_console: bool = True,
                 redis_server: RedisServer | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.is_console = is_console  # False: the controller's progress goes to its log too (benchmarks)
        self.redis_url = redis_url
        self.redis_server = redis_server  # the job's own server, restarted like a service when it dies
        self.config_path = run_dir / "config.json"
        self.config_path.write_text(config_to_json(config))
        (run_dir / "logs").mkdir(exist_ok=True)
        def service(name: str, kind: str, pool: str | None = None) -> Service:
            return Service(Lives(name, config.launch.max_restarts), kind, pool)

        rollouts = [service(f"rollout-{pool.name}-{i}", "rollout", pool.name)
                    for pool in config.rollout.pools for i in range(pool.num_workers)]
        envs = [service(f"env-{pool.name}-{i}", "env", pool.name)
                for pool in config.rollout.pools for i in range(pool.env_workers)] if config.has_agents else []
        self.services = [service("trainer", "trainer"), service("reward", "reward"), *rollouts, *envs,
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
        """The first life is the server `run` started; each later one restarts it from its append-only file."""
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
