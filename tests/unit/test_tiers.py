"""The suite's tiers (tests/tiers.py): a test that launches a job without `job` or `slow`, or starts a process or
uses Redis without `integration`, fails naming the marker, so a new job test cannot hide in the fast tier."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from tiers import is_toolchain, launched_verb, tier_error

JOB_ARGV = [sys.executable, "-m", "jetroll.services.cli", "run", "configs/smoke.yaml"]


@pytest.mark.parametrize(("argv", "verb"), [
    (JOB_ARGV, "run"),
    (["/repo/.venv/bin/jetroll", "bench", "engine"], "bench"),
    ([sys.executable, "-m", "jetroll.services.cli", "trainer", "--config", "c.json"], "trainer"),
    (["redis-server", "--port", "0"], None),
    ("jetroll run", None),  # a shell string names no argv
    ([sys.executable, "-m", "jetroll.services.cli", "run", "--help"], None),
])
def test_the_launched_verb_is_read_off_the_argv(argv: list[str] | str, verb: str | None) -> None:
    assert launched_verb(argv) == verb


def test_a_job_needs_job_or_slow_and_every_process_integration() -> None:
    assert "mark it `job`" in tier_error({"integration"}, JOB_ARGV)
    assert tier_error({"job", "integration"}, JOB_ARGV) == ""
    assert tier_error({"slow", "integration"}, JOB_ARGV) == ""
    assert "mark it `integration`" in tier_error(set(), ["redis-server"])
    assert "mark it `integration`" in tier_error({"slow"}, ["celery", "worker"])
    assert tier_error({"integration"}, ["redis-server"]) == ""
    # torch's own kernel builds are not the test's processes
    assert is_toolchain(["g++", "-O3", "kernel.cpp"]) and tier_error(set(), ["/usr/bin/g++", "x.cpp"]) == ""
    assert tier_error(set(), [sys.executable, "-m", "torch._inductor.compile_worker"]) == ""


@pytest.mark.integration
def test_the_tiers_fail_a_mismarked_test_in_a_real_run(pytester: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks, in a pytest of their own: each mismarked test fails naming its marker; the marked ones pass, and
    a job test is given `integration`; a process a library starts to probe the machine is not the test's."""
    pytester.makeini("[pytest]\nmarkers =\n    job\n    slow\n    integration\n")
    pytester.makepyfile(test_probe="""
        import multiprocessing, subprocess, pytest

        JOB = ["true", "jetroll.services.cli", "run"]  # `true` stands in for the job: the argv is what counts

        def test_unmarked_job():
            subprocess.run(JOB, check=True)

        @pytest.mark.integration
        def test_integration_job():
            subprocess.run(JOB, check=True)

        @pytest.mark.job
        def test_marked_job(request):
            subprocess.run(JOB, check=True)
            assert request.node.get_closest_marker("integration")

        def test_unmarked_process():
            subprocess.run(["true"], check=True)

        def test_unmarked_multiprocessing():
            process = multiprocessing.get_context("spawn").Process(target=print)
            process.start()
            process.join()

        @pytest.fixture
        def redis_url():
            return "redis://127.0.0.1:1"

        def test_unmarked_redis(redis_url):
            pass

        @pytest.mark.integration
        def test_marked_process(redis_url):
            subprocess.run(["true"], check=True)

        def test_a_library_probing_the_machine():
            import platform
            assert platform._Processor.from_subprocess() is not None  # `uname -p`, as the openai client's headers run
    """)
    tests = str(Path(__file__).resolve().parents[1])  # where tiers.py is
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess("-p", "tiers", "-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=3, failed=4, errors=1)  # the Redis one fails in its set-up
    result.stdout.fnmatch_lines_random([
        "*test_unmarked_job*launches `jetroll run`: mark it `job`*",
        "*test_integration_job*launches `jetroll run`: mark it `job`*",
        "*test_unmarked_process*mark it `integration`*",
        "*test_unmarked_multiprocessing*mark it `integration`*",
        "*test_unmarked_redis*uses a Redis server: mark it `integration`*",
    ])
