"""Integration fixtures shared by more than one module."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from bases import TEST_MODEL_CACHE, shared_base
from job_harness import REPO, SMOKE, Job, launch, stop
from moto.server import ThreadedMotoServer
from service_harness import build_model

from jetroll.functions.scoring import job_tasks
from jetroll.shared.config.job import load_config
from jetroll.shared.warm_start import ensure_base_model

CALCULATOR_SMOKE = REPO / "configs" / "calculator_smoke.yaml"
# dummy credentials, and no config files, for every AWS client a test or its subprocesses make
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}


@pytest.fixture
def aws_env() -> dict[str, str]:
    """AWS_ENV, for a subprocess's environment."""
    return dict(AWS_ENV)


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    """A moto S3 server on a free loopback port, with AWS_ENV in the environment."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with pytest.MonkeyPatch.context() as env:
        for name, value in AWS_ENV.items():
            env.setenv(name, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def model_path() -> str:
    """The smoke config's tiny base model, built once per machine (tests/bases.py)."""
    config = load_config(SMOKE, [f"model.cache_dir={TEST_MODEL_CACHE}"])
    return str(shared_base("smoke", lambda: ensure_base_model(config.model, job_tasks(config), progress=False)))


@pytest.fixture(scope="session")
def calculator_model_path() -> Iterator[str]:
    """configs/calculator_smoke.yaml's base: warm-started until it calls the calculator on some problems."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights; on a loaded 2-core machine two threads run the warm start ~10x slower
    try:
        config = load_config(CALCULATOR_SMOKE, [f"model.cache_dir={TEST_MODEL_CACHE}"])
        yield str(shared_base("calculator-smoke",
                              lambda: ensure_base_model(config.model, job_tasks(config), progress=False)))
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def start_job(tmp_path: Path, redis_url: str, model_path: str) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(*overrides: str, ignore_sigint: bool = False) -> Job:
        jobs.append(launch(tmp_path, redis_url, model_path, *overrides, ignore_sigint=ignore_sigint))
        return jobs[-1]

    yield start
    for job in jobs:
        stop(job)


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    """A random tiny model (service_harness.TINY) for services run in process."""
    with tempfile.TemporaryDirectory(prefix="jetroll-staleness-model-") as tmp:
        build_model(Path(tmp), seed=0)
        yield Path(tmp)
