"""The machine's processes as /proc lists them: what the benches that run a whole job need to find its services."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    parent: int
    state: str  # "Z" for a zombie
    args: list[bytes]
    cpu_s: float  # user + system CPU seconds so far, all threads

    @property
    def service(self) -> str | None:
        """`redis` for a redis-server, the service of `python -m jetroll.services.cli <service>`, else None."""
        if self.args and b"redis-server" in self.args[0]:
            return "redis"
        if b"jetroll.services.cli" in self.args and (at := self.args.index(b"jetroll.services.cli") + 1) < len(
                self.args):
            return self.args[at].decode()
        return None


def processes() -> dict[int, Process]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # they follow the parenthesised comm, which may hold spaces
        cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (stat's fields 14 and 15)
        found[int(entry.name)] = Process(int(entry.name), int(fields[1]), fields[0], args, cpu_s)
    return found


def descendants(root: int, table: dict[int, Process]) -> list[Process]:
    """`root` and every process below it."""
    children: dict[int, list[Process]] = {}
    for process in table.values():
        children.setdefault(process.parent, []).append(process)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            found.append(table[pid])
        todo.extend(p.pid for p in children.get(pid, []))
    return found


def stop_like_ctrl_c(job: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT, as Ctrl-C sends it, so a jetroll job stops its services and Redis; SIGKILL past `timeout_s`."""
    job.send_signal(signal.SIGINT)
    try:
        job.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        job.kill()


def run_job(command: list[str], env: dict[str, str], log_path: Path) -> tuple[int, float]:
    """A job in a subprocess, its output to `log_path`: (its exit code, its wall seconds). Interrupted, it is stopped
    like Ctrl-C first, so its services and Redis go with it."""
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = job.wait()
        except BaseException:
            stop_like_ctrl_c(job)
            raise
    return code, time.perf_counter() - started
