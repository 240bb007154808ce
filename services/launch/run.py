"""`jetroll run`, one flow for every launcher: resolve the job, start its Redis unless one is given (persisting under
`<run_dir>/redis`), let a launcher run the services until the job ends, stop everything. The local launcher
(processes) and the Ray one (actors and Serve deployments) differ only in how they start and supervise the services;
another layout of the same services on one machine plugs in the same way."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from jetroll.services.launch.redis_server import RedisServer
from jetroll.shared.config.job import JobConfig, config_tree, validate_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.protocol.client import RedisUnreachable, server_version
from jetroll.shared.tasks.dataset import DatasetTask
from jetroll.shared.tasks.registry import TaskSet


class JobLauncher(Protocol):
    where: str  # how the job's first line names it, e.g. "local" or "ray local"

    def supervise(self) -> int:
        """Start the services and run them until the controller finishes (0) or one is dead for good (1)."""
        ...

    def stop(self) -> None: ...


# (resolved config, run dir, Redis URL, the job's own Redis server or None) -> the launcher of its services
MakeLauncher = Callable[[JobConfig, Path, str, RedisServer | None], JobLauncher]


def run(config: JobConfig, make_launcher: MakeLauncher, run_dir: Path | None = None,
        redis_url: str | None = None) -> int:
    """Run one job to its end with the launcher `make_launcher` builds; the job's exit code."""
    run_dir = (run_dir or Path("runs") / config.job_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    redis_url = redis_url or config.redis.url
    if redis_url is not None:
        check_redis(redis_url)
    config = resolve_config(config, run_dir)
    server = None
    if redis_url is None:
        server = RedisServer(data_dir=run_dir / "redis").start()
        redis_url = server.url
    launcher = None
    try:
        launcher = make_launcher(config, run_dir, redis_url, server)
        print(f"jetroll: job {config.job_id} in {run_dir} (redis {redis_url}, {launcher.where}, pid {os.getpid()})",
              file=sys.stderr)
        code = launcher.supervise()
    except KeyboardInterrupt:
        print("jetroll: interrupted; stopping services", file=sys.stderr)
        code = 130
    except asyncio.CancelledError:  # SIGTERM, where the launcher's event loop takes it
        print("jetroll: terminated; stopping services", file=sys.stderr)
        code = 143
    finally:
        if launcher is not None:
            launcher.stop()
        if server is not None:
            server.stop()
    if code == 0:
        print(f"jetroll: done; see {run_dir / 'summary.json'}", file=sys.stderr)
    return code


def check_redis(redis_url: str) -> None:
    """A Redis the job is given must answer before anything is built: one line when it does not."""
    try:
        server_version(redis_url)
    except RedisUnreachable as exc:
        raise ConfigError(str(exc)) from exc


def resolve_config(config: JobConfig, run_dir: Path) -> JobConfig:
    """The config every service of a job reads: its datasets read and checked, the base model built or found
    (model.path), and the store root (or the S3 store's cache) and dataset paths made absolute, `<run_dir>/store`
    by default. `jetroll run` and the watch-mode controller both resolve a job this way."""
    from jetroll.functions.scoring import job_tasks
    from jetroll.shared.warm_start import ensure_base_model

    tasks = job_tasks(config)
    check_datasets(config, tasks)
    model_path = ensure_base_model(config.model, tasks)
    store_root = config.store.root or str(run_dir / "store")
    tree = config_tree(config)
    tree["model"]["path"] = str(Path(model_path).resolve())
    tree["model"]["init"] = "pretrained"  # what the services load, whatever built it
    tree["model"]["tokenizer"] = None  # the built model holds it
    tree["store"]["root"] = str(Path(store_root).resolve())
    for task in tree["tasks"]:
        for key in ("path", "heldout_path"):
            if task.get(key):
                task[key] = str(Path(task[key]).expanduser().resolve())
    return validate_config(tree)


def check_datasets(config: JobConfig, tasks: TaskSet) -> None:
    """Read every dataset task's files before anything starts: a missing file or an empty split fails here with
    one line (DatasetError), and the rows skipped as bad are counted."""
    for entry in config.tasks:
        if isinstance(task := tasks[entry.name], DatasetTask):
            rows = task.rows
            print(f"jetroll: dataset task {entry.name}: {len(rows.train)} training, {len(rows.probe)} probe and "
                  f"{len(rows.heldout)} held-out rows from {len(rows.files)} file(s); {len(rows.bad)} bad rows "
                  "skipped" + (f", {rows.heldout_overlap} training rows dropped as held-out duplicates"
                               if rows.heldout_overlap else ""), file=sys.stderr)
            if len(rows.heldout) < config.eval.num_problems:
                print(f"jetroll: dataset task {entry.name}: eval.num_problems is {config.eval.num_problems}, but it "
                      f"has {len(rows.heldout)} held-out rows: the eval scores those", file=sys.stderr)
