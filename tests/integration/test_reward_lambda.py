"""The Lambda backend (aioboto3 invoke) against the local Invoke-API endpoint serving the real handler.

Every case checks the final status the router records and, counted server-side, that no traj_id ran twice.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from fakes.lambda_invoke import DEFAULT_FUNCTION, FunctionSpec, LocalLambda
from reward_harness import REWARD_MODULES, by_traj_id, reward_tasks, running_router, started, traj, wait_scored

from jetroll.services.reward.backends import setup_backend
from jetroll.services.reward.backends.base import RewardCall
from jetroll.shared.config.reward import RewardConfig
from jetroll.shared.protocol.events import ScoredEvent
from jetroll.shared.protocol.topology import TRAJ_RAW

pytestmark = pytest.mark.integration

FUNCTION_TIMEOUT_S = 1.0


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore signs every request: dummy credentials, never real ones."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_SESSION_TOKEN", "testing"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)


@pytest.fixture
def endpoint() -> Iterator[Callable[..., LocalLambda]]:
    """Start a local Lambda endpoint serving `jetroll-reward` with the test rewards; stopped at teardown."""
    started: list[LocalLambda] = []

    def start(concurrency: int = 4, timeout_s: float = FUNCTION_TIMEOUT_S) -> LocalLambda:
        spec = FunctionSpec(timeout_s=timeout_s, concurrency=concurrency, modules=REWARD_MODULES)
        started.append(LocalLambda({DEFAULT_FUNCTION: spec}).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


def lambda_config(server: LocalLambda, **overrides: object) -> RewardConfig:
    fields = {"backend": "lambda", "timeout_s": FUNCTION_TIMEOUT_S, "lambda_endpoint_url": server.url, **overrides}
    return RewardConfig(**fields)


def route(redis_url: str, config: RewardConfig, events: list, **router_kwargs: object) -> dict[str, ScoredEvent]:
    """Publish `events` to a fresh job and run a router on the lambda backend until each is scored once."""
    job = events[0].job_id

    async def scenario() -> list:
        async with started(setup_backend("lambda", config, redis_url=redis_url, job_id=job)) as backend, \
                running_router(redis_url, job, {"lambda": backend}, max_retries=1,
                               max_throttle_retries=config.max_throttle_retries,
                               throttle_backoff_s=config.throttle_backoff_s, **router_kwargs) as (bus, _):
            for event in events:
                await bus.publish(TRAJ_RAW.name, event)
            return await wait_scored(bus, len(events), timeout_s=60)

    return by_traj_id(asyncio.run(scenario()))


def runs(server: LocalLambda, traj_id: str) -> int:
    return server.invocations[(DEFAULT_FUNCTION, traj_id)]


def test_ok_error_timeout_and_unknown_function(redis_url: str, endpoint: Callable[..., LocalLambda]) -> None:
    server = endpoint()
    config = lambda_config(server, lambda_functions={"test_pid": "no-such-function"})
    job = uuid.uuid4().hex[:8]
    events = [traj(job, "a0:0", "arithmetic", "12", "12"), traj(job, "a1:0", "t_raise", "x", ""),
              traj(job, "a2:0", "t_sleep", "5", ""), traj(job, "a3:0", "t_pid", "x", "")]
    with reward_tasks(t_raise="test_raise", t_sleep="test_sleep", t_pid="test_pid"):
        scored = route(redis_url, config, events)
    ok, raised, slow, missing = (scored[f"a{i}:0"] for i in range(4))
    assert (ok.status, ok.reward, ok.attempts, ok.backend) == ("ok", 1.0, 1, "lambda")
    # a Lambda error or timeout is final at once: the handler may have run
    assert (raised.status, raised.reward, raised.attempts) == ("error", None, 1)
    assert "RuntimeError: boom: x" in raised.details["error"]
    assert (slow.status, slow.reward, slow.attempts) == ("timeout", None, 1)
    assert "Task timed out after 1.00 seconds" in slow.details["error"]
    assert (missing.status, missing.reward, missing.attempts) == ("error", None, 1)
    assert "ResourceNotFoundException" in missing.details["error"]
    assert [runs(server, f"a{i}:0") for i in range(4)] == [1, 1, 1, 0]
    assert config.lambda_read_s > FUNCTION_TIMEOUT_S  # so the client never gave up on a running handler


def test_throttled_calls_are_retried_with_backoff(redis_url: str, endpoint: Callable[..., LocalLambda]) -> None:
    server = endpoint(concurrency=1)  # one environment: whichever call comes second is throttled (429)
    config = lambda_config(server, max_throttle_retries=8, throttle_backoff_s=0.1)
    job = uuid.uuid4().hex[:8]
    events = [traj(job, "b0:0", "t_sleep", "0.5", ""), traj(job, "b1:0", "arithmetic", "7", "7"),
              traj(job, "b2:0", "arithmetic", "8", "8")]
    with reward_tasks(t_sleep="test_sleep"):
        scored = route(redis_url, config, events)
    assert all((e.status, e.reward) == ("ok", 1.0) for e in scored.values())
    num_throttles = server.throttles[DEFAULT_FUNCTION]
    assert num_throttles >= 1
    assert sum(e.attempts for e in scored.values()) == len(events) + num_throttles  # one retry per 429
    assert all(runs(server, e) == 1 for e in scored)


def test_throttled_past_its_retries_is_final_and_never_invoked(
    redis_url: str, endpoint: Callable[..., LocalLambda]
) -> None:
    server = endpoint(concurrency=1, timeout_s=5.0)
    config = lambda_config(server, timeout_s=5.0, max_throttle_retries=2, throttle_backoff_s=0.05)

    async def scenario() -> tuple:
        job = uuid.uuid4().hex[:8]
        async with started(setup_backend("lambda", config, redis_url=redis_url, job_id=job)) as backend:
            hog = asyncio.create_task(backend.score(RewardCall("h0:0", 1, "test_sleep", "3", "")))
            await asyncio.sleep(1.0)  # the hog holds the only environment (cold start included)
            async with running_router(redis_url, job, {"lambda": backend}, max_throttle_retries=2,
                                      throttle_backoff_s=0.05) as (bus, _):
                await bus.publish(TRAJ_RAW.name, traj(job, "h1:0", "arithmetic", "1", "1"))
                scored = await wait_scored(bus, 1, timeout_s=30, grace_s=0.2)
            return scored, await hog

    scored, hog = asyncio.run(scenario())
    event = by_traj_id(scored)["h1:0"]
    assert (event.status, event.reward, event.attempts) == ("throttled", None, 3)
    assert "TooManyRequestsException" in event.details["error"]
    assert runs(server, "h1:0") == 0 and server.throttles[DEFAULT_FUNCTION] == 3
    assert hog.status == "ok" and runs(server, "h0:0") == 1


def test_one_invocation_per_traj_id(redis_url: str, endpoint: Callable[..., LocalLambda]) -> None:
    server = endpoint()
    config = lambda_config(server)
    job = uuid.uuid4().hex[:8]
    prefix = f"jetroll:{job}:reward:lambda"
    redis.Redis.from_url(redis_url).set(f"{prefix}:c1:0", b"invoking")  # a router died mid-invoke

    async def scenario() -> list:
        async with started(setup_backend("lambda", config, redis_url=redis_url, job_id=job)) as backend:
            first = await backend.score(RewardCall("c0:0", 1, "arithmetic", "5", "5"))
            again = await backend.score(RewardCall("c0:0", 2, "arithmetic", "5", "5"))  # a redelivery or retry
            lost = await backend.score(RewardCall("c1:0", 1, "arithmetic", "5", "5"))
            return [first, again, lost]

    first, again, lost = asyncio.run(scenario())
    assert first == again and (first.status, first.reward) == ("ok", 1.0)
    assert runs(server, "c0:0") == 1
    assert lost.status == "error" and "not invoking twice" in lost.detail and runs(server, "c1:0") == 0
