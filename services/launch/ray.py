"""The Ray launcher: the same job as the local launcher, placed on a Ray cluster.

- each rollout pool is a Ray Serve deployment `rollout-<pool>` (app `jetroll-<job_id>-<pool>`, no HTTP proxy):
  every replica runs one RolloutWorker that consumes `groups:<pool>` itself and pulls new weights itself;
  Serve keeps between `num_workers` and `max_workers` replicas by the pool's backlog and replaces a dead one;
- the trainer and the reward router are Ray actors that Ray restarts up to `launch.max_restarts` times;
- the controller runs in the driver (it owns the console); the job ends when it finishes;
- a Celery reward worker, when a task uses celery, runs beside the driver and is restarted like a local service.

Redis carries everything between them, as in the local launcher; `jetroll:{job_id}:replicas` maps each live
replica to the weight version it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from jetroll.services.launch.procs import Lives, stop_processes, supervise
from jetroll.services.reward.backends import needs_celery_worker
from jetroll.shared.config.job import JobConfig, config_tree, validate_config
from jetroll.shared.errors import JOB_FAILED_EXIT, ConfigError, JobFailedError
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.replicas import ReplicaVersions

log = logging.getLogger("jetroll.ray")

WANTED_REPLICAS = "wanted_replicas"  # the custom autoscaling metric each replica reports
REPORT_S = 0.1
STOP_TIMEOUT_S = 10.0


def _log_to_file(run_dir: Path, name: str) -> None:
    """Service logs go to <run_dir>/logs/<name>.log, as with the local launcher (on the node that runs it)."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "logs" / f"{name}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


class ServiceActor:
    """One service (trainer | reward | env, the last a pool's) as a Ray actor. A failed service ends its process, so
    Ray restarts the actor and retries `run` on it, up to `launch.max_restarts` times."""

    def __init__(self, kind: str, tree: dict[str, Any], redis_url: str, run_dir: str, pool: str | None = None,
                 name: str | None = None) -> None:
        from jetroll.services.launch.entrypoints import prepare_process

        self.kind, self.redis_url, self.run_dir, self.pool = kind, redis_url, Path(run_dir), pool
        self.name = name or kind
        self.config = validate_config(tree)
        prepare_process(kind, self.config)
        _log_to_file(self.run_dir, self.name)
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        import ray

        from jetroll.services.launch.entrypoints import service_main

        # a restarted service takes a new consumer name; the dead one's entries are reclaimed (XAUTOCLAIM)
        consumer = self.name
        if ray.get_runtime_context().was_current_actor_reconstructed:
            consumer = f"{self.name}-{os.getpid()}"
        self.task = asyncio.create_task(service_main(self.kind, self.config, self.redis_url, consumer, self.run_dir,
                                                     self.pool))
        try:
            await self.task
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("%s failed", consumer)
            logging.shutdown()
            os._exit(1)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


class RolloutReplica:
    """One rollout worker of a pool as a Serve replica. No requests flow through Serve: the worker consumes
    `groups:<pool>` and tails `weights` on the replica's event loop; `version()` and the replicas hash tell
    which weights it serves."""

    async def __init__(self, tree: dict[str, Any], redis_url: str, run_dir: str, pool: str) -> None:
        from ray import serve

        from jetroll.functions.scoring import job_tasks
        from jetroll.services.launch.entrypoints import prepare_process
        from jetroll.services.rollout.worker import RolloutWorker
        from jetroll.shared.store import setup_store

        config = validate_config(tree)
        prepare_process("rollout", config)
        self.name = f"rollout-{pool}-{serve.get_replica_context().replica_id.unique_id}"
        _log_to_file(Path(run_dir), self.name)
        self.bus = RedisBus.of_job(redis_url, config.job_id, config.redis)
        self.replicas = ReplicaVersions(self.bus)
        store = setup_store(config.store, config.job_id, Path(run_dir))
        self.worker = RolloutWorker(config, job_tasks(config), self.bus, store, self.name, pool)
        self.groups_per_replica = max(1, (self.worker.pool.max_batch or config.rollout.max_batch)
                                      // config.trainer.group_size)
        self.task = asyncio.create_task(self.worker.run())
        self.reporter = asyncio.create_task(self._report_version())

    def version(self) -> dict[str, Any]:
        """{"replica": name, "version": the weight version this replica decodes with (None before its first)}."""
        return {"replica": self.name, "version": self.worker.engine.version if self.worker.engine else None}

    async def _report_version(self) -> None:
        reported = None
        while True:
            version = self.version()["version"]
            if version is not None and version != reported:
                await self.replicas.report(self.name, version)
                reported = version
            await asyncio.sleep(REPORT_S)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric: replicas needed to give every unfinished group of the pool a slot."""
        try:
            backlog = await self.bus.lag(self.worker.stream.name, self.worker.stream.group)
        except ValueError:  # no consumer group yet: the worker is still starting
            backlog = 0
        return {WANTED_REPLICAS: math.ceil(backlog / self.groups_per_replica)}

    def check_health(self) -> None:
        """A worker that stopped makes the replica unhealthy, so Serve replaces it."""
        for task in (self.task, self.reporter):
            if task.done():
                cause = None if task.cancelled() else task.exception()
                raise RuntimeError(f"{self.name}: worker stopped") from cause

    async def __del__(self) -> None:
        # Serve calls this after a failed __init__ too: only what was set up is torn down
        tasks = [t for t in (getattr(self, "task", None), getattr(self, "reporter", None)) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if hasattr(self, "bus"):
            await self.replicas.withdraw(self.name)
            await self.bus.close()


def backlog_policy(ctx: Any) -> tuple[int, dict]:
    """Serve autoscaling policy of a rollout pool: the most replicas any replica asks for (its pool's backlog over
    its groups per replica). Serve clamps it to [num_workers, max_workers] and applies its up/down delays."""
    wanted = (ctx.aggregated_metrics or {}).get(WANTED_REPLICAS) or {}
    return (math.ceil(max(wanted.values())) if wanted else ctx.current_num_replicas), {}


class RayJob:
    """A job's services on a Ray cluster: a local one, or the one at `ray_address`, which it joins here and leaves
    in `stop`."""

    def __init__(self, config: JobConfig, run_dir: Path, redis_url: str, ray_address: str | None = None,
                 num_cpus: int | None = None) -> None:
        import ray

        self.config = config
        self.tree = config_tree(config)
        self.run_dir = run_dir
        self.redis_url = redis_url
        self.where = f"ray {ray_address or 'local'}"
        self.actors: dict[str, Any] = {}
        self.apps: list[str] = []
        self.celery: subprocess.Popen | None = None
        (run_dir / "logs").mkdir(exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(self.tree, indent=2))
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=ray_address, num_cpus=None if ray_address else num_cpus, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)

    def supervise(self) -> int:
        """Start the services, then run the controller here until it finishes (0), or until a service is dead for
        good (1)."""
        self._start()
        return asyncio.run(self._supervise())

    def _start(self) -> None:
        import ray
        from ray import serve

        launch = self.config.launch
        service_actor = ray.remote(ServiceActor)
        for kind, num_cpus, num_gpus in (("trainer", launch.trainer_num_cpus, launch.trainer_num_gpus),
                                         ("reward", launch.reward_num_cpus, 0.0)):
            self.actors[kind] = service_actor.options(
                name=f"jetroll-{self.config.job_id}-{kind}", num_cpus=num_cpus, num_gpus=num_gpus,
                max_restarts=launch.max_restarts, max_task_retries=-1,
            ).remote(kind, self.tree, self.redis_url, str(self.run_dir))
        if self.config.has_agents:  # each pool's environment workers (agents mostly wait: a fraction of a CPU)
            for pool in self.config.rollout.pools:
                for i in range(pool.env_workers):
                    name = f"env-{pool.name}-{i}"
                    self.actors[name] = service_actor.options(
                        name=f"jetroll-{self.config.job_id}-{name}", num_cpus=0.5, max_restarts=launch.max_restarts,
                        max_task_retries=-1,
                    ).remote("env", self.tree, self.redis_url, str(self.run_dir), pool.name, name)
        serve.start(proxy_location="Disabled")
        for pool in self.config.rollout.pools:
            resources: dict[str, Any] = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus}
            if pool.accelerator_type:
                resources["accelerator_type"] = pool.accelerator_type
            deployment = serve.deployment(RolloutReplica).options(
                name=f"rollout-{pool.name}", ray_actor_options=resources, graceful_shutdown_timeout_s=STOP_TIMEOUT_S,
                autoscaling_config={"min_replicas": pool.num_workers,
                                    "max_replicas": pool.max_workers or pool.num_workers,
                                    "policy": {"policy_function": f"{__name__}:backlog_policy"}})
            app = f"jetroll-{self.config.job_id}-{pool.name}"
            self.apps.append(app)
            serve.run(deployment.bind(self.tree, self.redis_url, str(self.run_dir), pool.name), name=app,
                      route_prefix=None)

    async def _supervise(self) -> int:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        services = {asyncio.wrap_future(actor.run.remote().future()): kind for kind, actor in self.actors.items()}
        controller = asyncio.create_task(self._controller())
        pending = {controller, *services}
        celery = None
        if needs_celery_worker(self.config.reward, [task.name for task in self.config.tasks]):
            celery = asyncio.create_task(self._celery_worker())
            pending.add(celery)
        try:
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if controller in done:
                    return controller.result()
                if celery in done:  # a worker serves until stopped: it died for good
                    return 1
                for future in done:
                    if future.exception() is not None:  # done without error: the trainer finished its steps
                        print(f"jetroll: service {services[future]} died after {self.config.launch.max_restarts} "
                              f"restarts: {str(future.exception()).splitlines()[0]}; see "
                              f"{self.run_dir / 'logs' / (services[future] + '.log')}", file=sys.stderr)
                        return 1
        finally:
            ours = [task for task in (controller, celery) if task is not None]
            for own in ours:
                own.cancel()
            await asyncio.gather(*ours, return_exceptions=True)

    async def _controller(self) -> int:
        from jetroll.services.launch.entrypoints import service_main

        lives = Lives("controller", self.config.launch.max_restarts)
        errors: list[Exception] = []

        async def life(consumer: str) -> int:
            try:
                await service_main("controller", self.config, self.redis_url, consumer, self.run_dir)
                return 0
            except JobFailedError as exc:
                errors.append(exc)
                return JOB_FAILED_EXIT
            except Exception as exc:
                log.exception("%s failed", consumer)
                errors.append(exc)
                return 1

        def on_death(consumer: str, code: int, is_restarted: bool) -> None:
            exc = errors[-1]
            what = f"restart {lives.num_restarts}/{lives.max_restarts}" if is_restarted else "giving up"
            print(f"jetroll: controller failed ({type(exc).__name__}: {exc}); {what}", file=sys.stderr)

        code = await supervise(lives, life, on_death)
        assert code is not None  # a life here always ends with a code
        return code

    async def _celery_worker(self) -> int:
        """The Celery reward worker beside the driver, restarted as the local launcher restarts it (a worker exits
        when it loses its broker); returns once it is dead for good."""
        lives = Lives("celery-worker", self.config.launch.max_restarts)

        async def life(consumer: str) -> int:
            self.celery = _start_celery(self.config, self.redis_url, self.run_dir, consumer)
            while (code := self.celery.poll()) is None:
                await asyncio.sleep(REPORT_S)
            stop_processes([self.celery], groups=True)  # its pool children outlive the main process
            return code

        def on_death(consumer: str, code: int, is_restarted: bool) -> None:
            what = f"restart {lives.num_restarts}/{lives.max_restarts}" if is_restarted else "giving up"
            print(f"jetroll: service celery-worker died (exit {code}); {what}; see "
                  f"{self.run_dir / 'logs' / 'celery-worker.log'}", file=sys.stderr)

        code = await supervise(lives, life, on_death, may_finish=False)
        assert code is not None
        return code

    def stop(self) -> None:
        import ray
        from ray import serve

        stopping = [actor.stop.remote() for actor in self.actors.values()]
        if stopping:
            ray.wait(stopping, num_returns=len(stopping), timeout=STOP_TIMEOUT_S)
        for app in self.apps:  # on a shared cluster, Serve and other jobs' apps stay
            with contextlib.suppress(Exception):
                serve.delete(app)
        # a replica deregisters itself on a graceful shutdown; one that crashed or was cut short leaves its entry
        asyncio.run(_clear_replicas(self.redis_url, self.config.job_id))
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        if self.celery is not None:  # its pool children outlive the main process: end the whole group
            stop_processes([self.celery], groups=True)
        ray.shutdown()


def _start_celery(config: JobConfig, redis_url: str, run_dir: Path, consumer: str) -> subprocess.Popen:
    """The Celery reward worker runs beside the driver, as the local launcher runs it."""
    from jetroll.services.launch.celery_worker import start_worker_process

    reward = config.reward
    with (run_dir / "logs" / "celery-worker.log").open("ab") as out:
        return start_worker_process(reward, reward.celery_broker_url or redis_url,
                                    f"jetroll-{config.job_id}-{consumer}@localhost", out)


async def _clear_replicas(redis_url: str, job_id: str) -> None:
    bus = RedisBus(redis_url, job_id)
    try:
        await ReplicaVersions(bus).clear()
    finally:
        await bus.close()


def run_ray_job(config: JobConfig, run_dir: Path | None = None, redis_url: str | None = None,
                ray_address: str | None = None, num_cpus: int | None = None) -> int:
    """`jetroll run --launcher ray`: a local Ray cluster (or the one at `ray_address`) runs the job's services."""
    try:
        import ray  # noqa: F401 - here only to refuse in one line where it is missing
    except ImportError:
        print("jetroll: the ray launcher needs Ray: pip install 'jetroll[ray]'", file=sys.stderr)
        return 2
    from jetroll.services.launch.run import run

    ray_address = ray_address or os.environ.get("RAY_ADDRESS")
    if ray_address and (redis_url or config.redis.url) is None:
        raise ConfigError("--ray-address: the services run on other nodes, so they need a Redis every node can "
                          "reach: pass --redis-url or set redis.url")
    return run(config, lambda resolved, directory, url, _server: RayJob(resolved, directory, url, ray_address,
                                                                         num_cpus),
               run_dir=run_dir, redis_url=redis_url)
