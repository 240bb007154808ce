"""Integration fixtures shared by more than one module."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer

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
