"""The local reward pool: results, failures as statuses, and kill-and-replace on timeout or death."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from jetroll.services.reward.pool import RewardPool

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # spawned workers inherit sys.path, so they can import reward_test_fns

MODULES = ("reward_test_fns",)
pytestmark = pytest.mark.integration  # the pool's worker processes


@pytest.fixture
def pool():
    p = RewardPool(num_workers=1, timeout_s=1.0, modules=MODULES)
    yield p
    p.close()


def test_ok(pool: RewardPool) -> None:
    status, out, detail = asyncio.run(pool.score("arithmetic", " 579 ", "579"))
    assert (status, detail) == ("ok", "")
    assert out is not None and out.reward == 1.0 and out.correct


def test_exception_is_error_and_worker_survives(pool: RewardPool) -> None:
    async def go():
        pids = pool.worker_pids()
        first = await pool.score("test_raise", "x", "y")
        second = await pool.score("arithmetic", "12", "13")
        return pids, first, second

    pids, (status, out, detail), (status2, out2, _) = asyncio.run(go())
    assert status == "error" and out is None
    assert "RuntimeError: boom: x" in detail
    assert status2 == "ok" and out2 is not None and not out2.correct
    assert pool.worker_pids() == pids


def test_unknown_reward_and_bad_return_are_errors(pool: RewardPool) -> None:
    async def go():
        return await pool.score("nope", "1", "1"), await pool.score("test_bad_type", "1", "1")

    (s1, _, d1), (s2, _, d2) = asyncio.run(go())
    assert s1 == "error" and "unknown reward 'nope'" in d1
    assert s2 == "error" and "not RewardOutput" in d2


def test_timeout_kills_and_replaces_worker(pool: RewardPool) -> None:
    async def go():
        await pool.score("arithmetic", "1", "1")  # worker is up
        old = pool.worker_pids()
        t0 = time.monotonic()
        result = await pool.score("test_sleep", "30", "")
        elapsed = time.monotonic() - t0
        new = pool.worker_pids()
        after = await pool.score("test_pid", "", str(new[0]))
        return old, result, elapsed, new, after

    old, (status, out, detail), elapsed, new, after = asyncio.run(go())
    assert status == "timeout" and out is None and "exceeded" in detail
    assert elapsed < 5
    assert new != old and new[0] is not None
    assert after[0] == "ok" and after[1] is not None and after[1].correct  # served by the new process
    assert pool.num_replaced == 1


def test_dead_worker_is_error_and_replaced(pool: RewardPool) -> None:
    async def go():
        old = pool.worker_pids()
        result = await pool.score("test_exit", "", "")
        return old, result, await pool.score("count", "1 2", "1 2")

    old, (status, out, detail), after = asyncio.run(go())
    assert status == "error" and out is None and "died" in detail
    assert pool.worker_pids() != old
    assert after[0] == "ok"


def test_concurrency_is_num_workers() -> None:
    with RewardPool(num_workers=3, timeout_s=5.0, modules=MODULES) as p:

        async def go():
            await asyncio.gather(*(p.score("arithmetic", "1", "1") for _ in range(3)))  # all started
            t0 = time.monotonic()
            results = await asyncio.gather(*(p.score("test_sleep", "0.5", "") for _ in range(3)))
            return time.monotonic() - t0, results

        elapsed, results = asyncio.run(go())
        assert [r[0] for r in results] == ["ok"] * 3
        assert elapsed < 1.4  # three 0.5 s calls ran in parallel, not one after another
        assert len(set(p.worker_pids())) == 3


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=0, timeout_s=1.0)
    with pytest.raises(ModuleNotFoundError):
        RewardPool(num_workers=1, timeout_s=1.0, modules=("no_such_module_xyz",))
