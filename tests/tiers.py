"""The suite's tiers, held while every test runs, so that no test can hide in a cheaper tier than it costs:
- a test that launches a job, bench or eval (`jetroll run|bench|eval` as a subprocess) is marked `job` or `slow`;
- a test that starts any other subprocess or process, or uses a Redis server, is marked `integration`.
The fast tier (`make test-fast`) is `-m "not slow and not job"`. A test that breaks a rule fails, naming the marker."""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

LAUNCH_VERBS = {"run", "bench", "eval"}
REDIS_FIXTURES = {"redis_url", "any_redis_url", "redis_binary", "redis_servers"}
# what torch runs of its own to build kernels (the decode's C++ attention, inductor's graphs): a cost of the model, not
# of a server or a service, and run only on a cold cache
TOOLCHAIN = {"gcc", "g++", "cc", "c++", "clang", "clang++", "ninja"}
# processes libraries start to probe the machine, not servers or services: torch's kernel builders (inductor's vector
# ISA check starts a Python), `platform.processor()`'s `uname -p` (the openai client's headers) and `distro`
MACHINE_PROBES = ("/torch/_inductor/", "/torch/utils/cpp_extension", "/platform.py", "/distro/")


def launched_verb(args: Any) -> str | None:
    """The jetroll verb an argv starts (`python -m jetroll.services.cli run ...`, `jetroll bench ...`), or None;
    `--help` starts nothing."""
    argv = [str(arg) for arg in args] if isinstance(args, Sequence) and not isinstance(args, str | bytes) else []
    if "--help" in argv:
        return None
    for i, arg in enumerate(argv[:-1]):
        if arg == "jetroll.services.cli" or (i == 0 and arg.rsplit("/", 1)[-1] == "jetroll"):
            return argv[i + 1]
    return None


def is_toolchain(args: Any) -> bool:
    argv = [str(arg) for arg in args] if isinstance(args, Sequence) and not isinstance(args, str | bytes) else [args]
    return str(argv[0]).rsplit("/", 1)[-1] in TOOLCHAIN or any("torch._inductor" in str(arg) for arg in argv)


def started_to_probe_the_machine() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in MACHINE_PROBES):
            return True
        frame = frame.f_back
    return False


def tier_error(markers: set[str], args: Any) -> str:
    """Why a test with `markers` may not start a process with `args` ("" when it may)."""
    if is_toolchain(args):
        return ""
    verb = launched_verb(args)
    if verb in LAUNCH_VERBS and not markers & {"job", "slow"}:
        return f"launches `jetroll {verb}`: mark it `job` (or `slow`)"
    if "integration" not in markers:
        return f"starts a process ({' '.join(map(str, args)) if isinstance(args, Sequence) else args!r:.120}): " \
               "mark it `integration`"
    return ""


@contextmanager
def tier_guard(item: pytest.Item) -> Iterator[None]:
    """While `item` sets up or runs, refuse a subprocess or process its markers do not admit."""
    markers = {mark.name for mark in item.iter_markers()}
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def guarded_popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if (why := tier_error(markers, args)) and not started_to_probe_the_machine():
            pytest.fail(f"{item.nodeid} {why}", pytrace=False)
        popen_init(self, args, *rest, **kwargs)

    def guarded_start(self: multiprocessing.process.BaseProcess) -> None:
        if why := tier_error(markers, [f"multiprocessing {self.name}"]):
            pytest.fail(f"{item.nodeid} {why}", pytrace=False)
        process_start(self)

    subprocess.Popen.__init__ = guarded_popen_init  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = process_start  # type: ignore[method-assign]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("job"):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    if REDIS_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("integration"):
        pytest.fail(f"{item.nodeid} uses a Redis server: mark it `integration`", pytrace=False)
    with tier_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with tier_guard(item):
        return (yield)
