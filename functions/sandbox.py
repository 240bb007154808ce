"""Run untrusted Python in a subprocess that cannot hurt the host: rlimits, a wall clock, a private uid, no network.

As root (how jetroll's containers run), each run leases its own unprivileged uid from a range no account uses,
so RLIMIT_NPROC counts only that run's processes, and one kill(-1) from that uid ends everything the run started,
`setsid` escapes included. Without root the code runs as the host's uid: the limits and the timeout still hold,
but it could signal the host, so that is logged once.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import logging
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

__all__ = ["DEFAULT_LIMITS", "LimitName", "SandboxLimits", "SandboxResult", "run_python"]

log = logging.getLogger(__name__)

LimitName = Literal["wall_time", "cpu_time", "memory", "file_size", "processes"]

# Sandbox uids: _UID_BASE + slot. Debian reserves 65000-65533 (no package or account takes them), and they stay
# below 65536, so they exist even in a rootless container's uid map.
_UID_BASE = 65_000
_NUM_UIDS = 512
# Fixed, not $TMPDIR: every process on the host shares it. Root-owned, mode 0711: it holds one lock file per
# uid (0600) and the scratch directory of each running uid (owned by that uid, 0700).
_ROOT = Path("/tmp/jetroll-sandbox")
_NOBODY = 65534
_CLONE_NEWNET = 0x40000000
# Resolved here, in the parent: a dlsym in the forked child could deadlock on a loader lock held by another thread.
_LIBC_UNSHARE = ctypes.CDLL(None, use_errno=True).unshare
_SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits of one run. Memory is address space per process (RLIMIT_AS); processes count threads too."""

    cpu_s: int = 2
    wall_s: float = 3.0
    memory_bytes: int = 512 * 2**20
    num_procs: int = 16
    file_size_bytes: int = 16 * 2**20
    output_bytes: int = 2**20  # kept of stdout (its head) and of stderr (its tail)

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_bytes", "num_procs", "file_size_bytes", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """How a run ended. `killed_by_limit` is best effort: signals for CPU and file size, and for memory, file size
    and processes the child's last stderr line (Python turns those limits into exceptions, not signals)."""

    exit_code: int  # negative: killed by that signal, as in Popen.returncode
    stdout: str
    stderr: str
    timed_out: bool
    killed_by_limit: LimitName | None
    duration_s: float


def run_python(code: str, stdin: str = "", limits: SandboxLimits = DEFAULT_LIMITS) -> SandboxResult:
    """Run `code` as a script with `stdin`, in a fresh scratch directory that is removed afterwards.

    Raises only when the sandbox itself cannot run (no usable interpreter, no free uid); whatever the code does
    is reported in the result. Every process the run started has been sent SIGKILL when this returns.
    """
    interpreter = _interpreter()
    is_net_isolated = _can_unshare_net()
    with _workspace() as (scratch, uid), ExitStack() as files:
        # errors="replace": model text can hold lone surrogates, which UTF-8 cannot encode.
        (scratch / "main.py").write_bytes(code.encode(errors="replace"))
        if uid is not None:
            os.chown(scratch / "main.py", uid, uid)
        # Anonymous files, not pipes: nothing to drain while waiting, and RLIMIT_FSIZE bounds what the code writes.
        stdin_file, stdout_file, stderr_file = (files.enter_context(tempfile.TemporaryFile()) for _ in range(3))
        stdin_file.write(stdin.encode(errors="replace"))
        stdin_file.seek(0)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8"}
        start = time.monotonic()
        proc = subprocess.Popen(
            [interpreter, "-I", "main.py"],
            stdin=stdin_file,
            stdout=stdout_file,
            stderr=stderr_file,
            cwd=scratch,
            env=env,
            start_new_session=True,
            preexec_fn=_child_setup(limits, uid, is_net_isolated),
        )
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_run(proc, uid)
            proc.wait()
        duration_s = time.monotonic() - start
        stdout = _read(stdout_file, limits.output_bytes, tail=False)
        stderr = _read(stderr_file, limits.output_bytes, tail=True)
    assert proc.returncode is not None
    return SandboxResult(
        exit_code=proc.returncode,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        killed_by_limit=_limit_hit(proc.returncode, timed_out, stderr),
        duration_s=duration_s,
    )


def _child_setup(limits: SandboxLimits, uid: int | None, is_net_isolated: bool) -> Callable[[], None]:
    """The preexec_fn: runs in the forked child before exec. Values are computed here, in the parent."""
    rlimits = [
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),  # SIGXCPU, then SIGKILL a second later
        (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
        (resource.RLIMIT_NPROC, limits.num_procs, limits.num_procs),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes, limits.file_size_bytes),
        (resource.RLIMIT_CORE, 0, 0),  # a core dump of a memory hog would be as large as the memory limit
    ]
    rlimits = [(res, _capped(res, soft), _capped(res, hard)) for res, soft, hard in rlimits]

    def setup() -> None:
        # Order matters: the network namespace needs root, and root must be dropped last.
        if is_net_isolated:
            _unshare_net()
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)

    return setup


def _capped(res: int, value: int) -> int:
    """`value`, or the host's hard limit when that is lower (setrlimit cannot raise it)."""
    hard = resource.getrlimit(res)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def _unshare_net() -> None:
    """Enter a new, empty network namespace (loopback down). os.unshare needs Python 3.12."""
    if _LIBC_UNSHARE(_CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unshare(CLONE_NEWNET): {os.strerror(code)}")


@functools.cache
def _can_unshare_net() -> bool:
    """Whether this host lets us give the child its own network namespace (needs CAP_SYS_ADMIN)."""
    try:
        subprocess.run([sys.executable, "-I", "-S", "-c", ""], preexec_fn=_unshare_net, check=True)
    except (OSError, subprocess.SubprocessError):
        log.warning("sandbox: cannot unshare the network namespace here; sandboxed code keeps network access")
        return False
    return True


@functools.cache
def _interpreter() -> str:
    """A Python that an unprivileged uid can run: ours if it is world-readable, else the system one."""
    if os.geteuid() != 0:
        log.warning("sandbox: not root, so sandboxed code runs as this process's uid %d", os.geteuid())
        return sys.executable
    for candidate in (sys.executable, _SYSTEM_PYTHON):
        try:
            subprocess.run([candidate, "-I", "-S", "-c", ""], user=_NOBODY, group=_NOBODY, extra_groups=[], check=True)
        except (OSError, subprocess.CalledProcessError):
            continue
        if candidate != sys.executable:
            log.info("sandbox: %s is not usable by other users; running code with %s", sys.executable, candidate)
        return candidate
    raise RuntimeError(f"sandbox: neither {sys.executable} nor {_SYSTEM_PYTHON} can be run by uid {_NOBODY}")


@contextmanager
def _workspace() -> Iterator[tuple[Path, int | None]]:
    """A fresh scratch directory and, as root, the uid leased for this run that owns it.

    The caller kills the run's processes before leaving. The directory is removed only on a clean exit: as root,
    one left behind tells the next lease of its uid to clean up after this run.
    """
    if os.geteuid() != 0:
        scratch = Path(tempfile.mkdtemp(prefix="jetroll-sandbox-"))
        yield scratch, None
        shutil.rmtree(scratch)
        return
    with _lease_uid() as uid:
        scratch = _ROOT / str(uid)
        scratch.mkdir(mode=0o700)
        os.chown(scratch, uid, uid)
        yield scratch, uid
        shutil.rmtree(scratch)


@contextmanager
def _lease_uid() -> Iterator[int]:
    """Hold one sandbox uid, by an flock that every process on the host shares.

    If the uid's scratch directory is still there, its last run never cleaned up (its host died, e.g. a reward
    pool killed an overrunning worker): kill what that run left running and remove the directory first.
    """
    _ROOT.mkdir(exist_ok=True)
    info = _ROOT.lstat()
    # /tmp is world-writable: refuse a path that a sandboxed process could have planted.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
        raise RuntimeError(f"sandbox: {_ROOT} must be a directory owned by root")
    _ROOT.chmod(0o711)  # not via mkdir's mode, which the umask can narrow
    start = random.randrange(_NUM_UIDS)
    for i in range(_NUM_UIDS):
        uid = _UID_BASE + (start + i) % _NUM_UIDS
        fd = os.open(_ROOT / f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            leftover = _ROOT / str(uid)
            if leftover.exists():
                log.warning("sandbox: cleaning up after a run of uid %d whose host died", uid)
                _kill_uid(uid)
                shutil.rmtree(leftover)
            yield uid
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"sandbox: all {_NUM_UIDS} sandbox uids are in use")


def _kill_run(proc: subprocess.Popen[bytes], uid: int | None) -> None:
    """SIGKILL everything the run started: all processes of its uid, or without one, its process group."""
    if uid is not None:
        _kill_uid(uid)
        return
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _kill_uid(uid: int) -> None:
    # kill(-1) from the uid signals all of its processes in one pass under the kernel's task list lock, and a
    # process with SIGKILL pending cannot finish a fork, so a fork bomb cannot outrun it.
    subprocess.run(
        [_interpreter(), "-I", "-S", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)"],
        user=uid,
        group=uid,
        extra_groups=[],
        check=True,
    )


def _read(file: IO[bytes], max_bytes: int, *, tail: bool) -> str:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - max_bytes) if tail else 0)
    return file.read(max_bytes).decode(errors="replace")


def _limit_hit(exit_code: int, timed_out: bool, stderr: str) -> LimitName | None:
    if timed_out:
        return "wall_time"
    if exit_code == 0:
        return None
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGKILL: the hard CPU limit, if SIGXCPU was ignored
        return "cpu_time"
    if exit_code == -signal.SIGXFSZ:
        return "file_size"
    last_line = stderr.rstrip().rpartition("\n")[2]
    if last_line.startswith("MemoryError"):
        return "memory"
    if f"[Errno {errno.EFBIG}]" in last_line:
        return "file_size"
    if f"[Errno {errno.EAGAIN}]" in last_line or "can't start new thread" in last_line:
        return "processes"
    return None
