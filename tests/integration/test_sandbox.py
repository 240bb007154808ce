"""The sandbox holds hostile code within its limits and leaves the host healthy; the code reward runs in it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

from jetroll.functions import sandbox
from jetroll.functions.builtin import code_reward
from jetroll.functions.runner import get_reward
from jetroll.functions.sandbox import SandboxLimits, run_python

pytestmark = pytest.mark.integration

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid-based containment needs root, as deployed")

REPO = Path(__file__).parents[2]
FAST = SandboxLimits(cpu_s=1, wall_s=2.0)


def _live_sandbox_pids(uids: Collection[int] | None = None, parent: int | None = None) -> list[int]:
    """Processes of a sandbox uid (of `uids`, or any) that are not zombies (a zombie is dead; init reaps it), and
    with `parent`, only its children. Other pytest workers run sandboxes too, so a test looks at its own."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
        except OSError:  # exited while we looked
            continue
        uid = int(status["Uid"].split()[0])
        if not sandbox._UID_BASE <= uid < sandbox._UID_BASE + sandbox._NUM_UIDS or status["State"].split()[0] == "Z":
            continue
        if (uids is None or uid in uids) and (parent is None or int(status["PPid"]) == parent):
            pids.append(int(entry.name))
    return pids


def _wait_for(condition: Callable[[], object], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(autouse=True)
def leased_uids(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[int]]:
    """The sandbox uids the test leases in this process. After every test: the host can fork, and no process or
    scratch directory of those uids is left."""
    leased: set[int] = set()
    lease_uid = sandbox._lease_uid

    @contextmanager
    def recorded_lease() -> Iterator[int]:
        with lease_uid() as uid:
            leased.add(uid)
            yield uid

    monkeypatch.setattr(sandbox, "_lease_uid", recorded_lease)
    yield leased
    assert subprocess.run(["true"]).returncode == 0
    assert _wait_for(lambda: not _live_sandbox_pids(leased)), f"stray sandbox processes: {_live_sandbox_pids(leased)}"
    assert [uid for uid in leased if (sandbox._ROOT / str(uid)).exists()] == []


def test_runs_code_with_stdin() -> None:
    result = run_python("import sys\nprint(sys.stdin.read()[::-1])\nprint('warn', file=sys.stderr)", "abc")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "cba\n", "warn\n")
    assert not result.timed_out and result.killed_by_limit is None


def test_infinite_loop_hits_the_cpu_limit() -> None:
    result = run_python("while True:\n    pass", limits=SandboxLimits(cpu_s=1, wall_s=10.0))
    assert result.exit_code == -signal.SIGXCPU and result.killed_by_limit == "cpu_time" and not result.timed_out
    assert result.duration_s < 5


def test_sleeping_forever_hits_the_wall_clock() -> None:
    result = run_python("import time\ntime.sleep(600)", limits=SandboxLimits(wall_s=0.5))
    assert result.timed_out and result.killed_by_limit == "wall_time" and result.exit_code == -signal.SIGKILL
    assert result.duration_s < 2


@requires_root
def test_fork_bomb_is_contained_and_fully_killed(leased_uids: set[int]) -> None:
    # Children leave the process group with setsid, so killing the group alone would miss them.
    bomb = """
import os, time
while True:
    try:
        if os.fork() == 0:
            os.setsid()
    except OSError:
        time.sleep(0.001)
"""
    start = time.monotonic()
    result = run_python(bomb, limits=SandboxLimits(cpu_s=1, wall_s=1.0, num_procs=8))
    assert result.timed_out and time.monotonic() - start < 5
    assert leased_uids and _wait_for(lambda: not _live_sandbox_pids(leased_uids), timeout_s=2.0)
    assert subprocess.run(["true"]).returncode == 0
    # The limit binds: a program that counts how many processes it can hold gets num_procs - 1 children.
    counter = """
import os, time
children = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children += 1
print(children)
"""
    assert run_python(counter, limits=SandboxLimits(num_procs=8)).stdout == "7\n"


def test_memory_hog_hits_the_memory_limit() -> None:
    for hog in ("x = bytearray(8 * 2**30)", "chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))"):
        result = run_python(hog, limits=SandboxLimits(memory_bytes=256 * 2**20))
        assert result.exit_code == 1 and result.killed_by_limit == "memory", result.stderr
    assert len(bytearray(2**28)) == 2**28  # the host still allocates freely


def test_big_file_hits_the_file_size_limit() -> None:
    result = run_python("open('big', 'wb').write(b'x' * 2**22)", limits=SandboxLimits(file_size_bytes=2**20))
    assert result.killed_by_limit == "file_size", result.stderr


@requires_root
def test_cannot_write_outside_the_scratch_directory() -> None:
    host_dir = Path(tempfile.mkdtemp())
    host_dir.chmod(0o755)  # readable and enterable by anyone, writable only by root: like the repo
    host_file = host_dir / "data.txt"
    host_file.write_text("host data")
    escape = REPO / f"escape-{uuid.uuid4().hex}.txt"
    code = f"""
import os
for path in ({str(host_dir / 'new.txt')!r}, {str(host_file)!r}, {str(escape)!r}):
    try:
        open(path, "a").write("pwned")
        print("wrote", path)
    except OSError as exc:
        print(type(exc).__name__)
open("inside.txt", "w").write("scratch is writable")
print(os.getcwd(), open("inside.txt").read())
"""
    try:
        result = run_python(code)
        lines = result.stdout.splitlines()
        assert result.exit_code == 0 and lines[:3] == ["PermissionError"] * 3, result.stdout + result.stderr
        scratch, inside = lines[3].split(" ", 1)
        assert inside == "scratch is writable" and not Path(scratch).exists()  # removed after the run
        assert sorted(p.name for p in host_dir.iterdir()) == ["data.txt"] and host_file.read_text() == "host data"
        assert not escape.exists()
    finally:
        escape.unlink(missing_ok=True)
        host_file.unlink()
        host_dir.rmdir()


@requires_root
def test_cannot_read_the_parents_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("JETROLL_TEST_SECRET", secret)
    code = f"""
import os
print(sorted(os.environ))
for path in ("/proc/{os.getpid()}/environ", "/proc/1/environ", "/proc/{os.getpid()}/cmdline"):
    try:
        print(open(path, "rb").read())
    except OSError as exc:
        print(path, type(exc).__name__)
"""
    result = run_python(code)
    assert result.exit_code == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    assert json.loads(result.stdout.splitlines()[0].replace("'", '"')) == ["HOME", "LANG", "PATH", "TMPDIR"]
    assert f"/proc/{os.getpid()}/environ PermissionError" in result.stdout
    assert "/proc/1/environ PermissionError" in result.stdout


def test_no_network() -> None:
    if not sandbox._can_unshare_net():
        pytest.skip("this host cannot unshare the network namespace (needs CAP_SYS_ADMIN)")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"""
import socket
print([name for _, name in socket.if_nameindex()])
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as exc:
    print(exc.errno)
"""
        result = run_python(code)
        assert result.exit_code == 0, result.stderr
        assert result.stdout.splitlines() == ["['lo']", "101"]  # ENETUNREACH: only a loopback device, and it is down
        with pytest.raises(BlockingIOError):
            listener.accept()


@requires_root
def test_next_lease_cleans_up_after_a_dead_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward pool kills a worker that overruns: the sandboxed process it leaves is killed by the uid's next lease."""
    host_code = "from jetroll.functions.sandbox import run_python; run_python('import time\\ntime.sleep(600)')"
    host = subprocess.Popen([sys.executable, "-c", host_code], cwd=REPO)
    try:
        assert _wait_for(lambda: _live_sandbox_pids(parent=host.pid)), "the sandboxed process never started"
        (orphan,) = _live_sandbox_pids(parent=host.pid)
        host.kill()
    finally:
        host.wait()
    uid = Path(f"/proc/{orphan}").stat().st_uid
    assert (sandbox._ROOT / str(uid)).is_dir()
    monkeypatch.setattr(sandbox.random, "randrange", lambda n: uid - sandbox._UID_BASE)
    with sandbox._lease_uid() as leased:
        assert leased == uid and not (sandbox._ROOT / str(uid)).exists()
        assert _wait_for(lambda: not _live_sandbox_pids({uid}), timeout_s=2.0)


ADD_STDIO = {"stdio": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "-5 5", "stdout": "0"}]}


def test_code_reward_stdio() -> None:
    good = "Read two ints.\n```python\na, b = map(int, input().split())\nprint(a + b)  \n```\nDone."
    out = code_reward(good, json.dumps(ADD_STDIO))
    assert (out.reward, out.correct, out.details) == (1.0, True, "passed 2 tests")
    assert get_reward("code") is code_reward and code_reward(good, ADD_STDIO) == out  # a decoded dict works too
    wrong = good.replace("a + b", "a - b")
    assert code_reward(wrong, ADD_STDIO).details == "test 1/2 failed: wrong output"


def test_code_reward_asserts() -> None:
    tests = {"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
    assert code_reward("```py\ndef add(a, b):\n    return a + b\n```", tests).correct
    out = code_reward("def add(a, b):\n    return a * b", tests)  # no fence: the whole text is the code
    assert (out.reward, out.correct) == (0.0, False)
    assert out.details == "test 1/2 failed: exit code 1: AssertionError"
    out = code_reward("```python\ndef add(a, b):\n    return 1 / 0\n```", tests)
    assert out.details == "test 1/2 failed: exit code 1: ZeroDivisionError: division by zero"


@pytest.mark.parametrize("garbage", ["", "lorem ipsum }}} ```", "```python\n", "\x00\x01", "\ud800 lone surrogate"])
def test_code_reward_garbage_scores_zero(garbage: str) -> None:
    out = code_reward(garbage, ADD_STDIO)
    assert (out.reward, out.correct) == (0.0, False) and out.details.startswith("test 1/2 failed")


def test_code_reward_hostile_code_scores_zero() -> None:
    out = code_reward("import time\ntime.sleep(600)", {"asserts": ["assert True"]})
    assert out.details == "test 1/1 failed: hit the wall_time limit"


def test_code_reward_bad_answer_raises() -> None:
    with pytest.raises(ValueError, match="no tests"):
        code_reward("print(1)", "{}")
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        code_reward("print(1)", {"stdio": [{"input": "1"}]})
    with pytest.raises(msgspec.DecodeError):
        code_reward("print(1)", "not json")


def test_output_keeps_the_head_of_stdout_and_the_tail_of_stderr() -> None:
    code = "import sys\nsys.stdout.write('x' * 10**6)\nsys.stderr.write('y' * 10**6 + 'END')"
    result = run_python(code, limits=SandboxLimits(output_bytes=1000))
    assert result.stdout == "x" * 1000 and result.stderr == "y" * 997 + "END"
