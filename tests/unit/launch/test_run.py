"""`jetroll run`'s one flow, whatever the launcher: the job's own Redis persists under the run dir, a given Redis is
checked before anything is built, and what a launcher started is stopped however it ends."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from helpers import aof_path

from jetroll.services.launch.redis_server import RedisServer
from jetroll.services.launch.run import run
from jetroll.shared.config.job import JobConfig, validate_config
from jetroll.shared.errors import ConfigError

pytestmark = pytest.mark.integration


def job(tmp_path: Path) -> JobConfig:
    model = tmp_path / "model"  # enough of a base model for resolve_config: its config.json
    model.mkdir()
    (model / "config.json").write_text("{}")
    return validate_config({"job_id": "runflow", "model": {"path": str(model)}})


class RecordingLauncher:
    """Writes one key through the job's Redis and ends with `code`; records what `run` gave it."""

    where = "recording"

    def __init__(self, code: int) -> None:
        self.code, self.seen, self.stopped = code, {}, False

    def __call__(self, config: JobConfig, run_dir: Path, redis_url: str, server: RedisServer | None):
        self.seen = {"config": config, "run_dir": run_dir, "redis_url": redis_url, "server": server}
        return self

    def supervise(self) -> int:
        client = redis.Redis.from_url(self.seen["redis_url"])
        client.set("written-by", "the launcher")
        client.close()
        if self.code == 130:
            raise KeyboardInterrupt
        return self.code

    def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("code", [0, 1, 130])
def test_the_jobs_own_redis_persists_under_the_run_dir_and_stops_with_it(tmp_path: Path, code: int) -> None:
    launcher = RecordingLauncher(code)
    assert run(job(tmp_path), launcher, run_dir=tmp_path / "run") == code
    server = launcher.seen["server"]
    assert isinstance(server, RedisServer) and server.data_dir == (tmp_path / "run" / "redis").resolve()
    assert launcher.stopped and not server.is_running
    deadline = time.monotonic() + 5  # appendfsync everysec: the write reaches the file within a second or so
    while b"written-by" not in aof_path(server.data_dir).read_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert b"written-by" in aof_path(server.data_dir).read_bytes()
    assert launcher.seen["config"].model.init == "pretrained"  # the launcher gets the resolved config


def test_a_given_redis_that_does_not_answer_fails_before_anything_is_built(tmp_path: Path) -> None:
    launcher = RecordingLauncher(0)
    with pytest.raises(ConfigError, match="cannot reach Redis at redis://127.0.0.1:1/0"):
        run(job(tmp_path), launcher, run_dir=tmp_path / "run", redis_url="redis://127.0.0.1:1/0")
    assert launcher.seen == {} and not launcher.stopped


def test_a_given_redis_is_used_and_no_server_is_started(tmp_path: Path, redis_url: str) -> None:
    launcher = RecordingLauncher(0)
    assert run(job(tmp_path), launcher, run_dir=tmp_path / "run", redis_url=redis_url) == 0
    assert launcher.seen["redis_url"] == redis_url and launcher.seen["server"] is None and launcher.stopped
    assert not (tmp_path / "run" / "redis").exists()
