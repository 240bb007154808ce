"""The one restart loop every launcher shares: lives, consumer names, and what ends a service."""

from __future__ import annotations

import asyncio

from jetroll.services.launch.procs import Lives, supervise
from jetroll.shared.errors import JOB_FAILED_EXIT


def run(codes: list[int | None], max_restarts: int, may_finish: bool = True) -> tuple[int | None, list, list]:
    """Supervise a service whose lives exit with `codes` in turn; the code returned, the consumers run, the deaths."""
    consumers: list[str] = []
    deaths: list[tuple[str, int, bool]] = []
    remaining = iter(codes)

    async def life(consumer: str) -> int | None:
        consumers.append(consumer)
        return next(remaining)

    code = asyncio.run(supervise(Lives("rollout-0", max_restarts), life,
                                 lambda *death: deaths.append(death), may_finish=may_finish))
    return code, consumers, deaths


def test_each_life_runs_under_a_new_consumer_until_one_finishes() -> None:
    code, consumers, deaths = run([-9, 4, 0], max_restarts=3)
    assert code == 0
    assert consumers == ["rollout-0", "rollout-0-r1", "rollout-0-r2"]
    assert deaths == [("rollout-0", -9, True), ("rollout-0-r1", 4, True)]


def test_a_life_that_failed_the_job_is_not_restarted() -> None:
    """JOB_FAILED_EXIT (the dead-letter alarm's exit): the job cannot succeed, so a restart would only repeat it."""
    code, consumers, deaths = run([JOB_FAILED_EXIT, 0], max_restarts=3)
    assert code == JOB_FAILED_EXIT
    assert consumers == ["rollout-0"]
    assert deaths == [("rollout-0", JOB_FAILED_EXIT, False)]


def test_a_death_past_the_budget_returns_its_code() -> None:
    code, consumers, deaths = run([1, 2, 7], max_restarts=2)
    assert code == 7
    assert len(consumers) == 3
    assert deaths[-1] == ("rollout-0-r2", 7, False)


def test_a_job_that_ended_first_ends_the_service_without_a_death() -> None:
    code, consumers, deaths = run([None], max_restarts=1)
    assert (code, consumers, deaths) == (None, ["rollout-0"], [])


def test_a_service_that_serves_until_stopped_dies_by_exiting_cleanly() -> None:
    code, consumers, deaths = run([0, 0], max_restarts=1, may_finish=False)
    assert code == 0
    assert consumers == ["rollout-0", "rollout-0-r1"]
    assert deaths == [("rollout-0", 0, True), ("rollout-0-r1", 0, False)]
