"""The machine's processes as /proc lists them: what the benches that run a whole job need to find its services."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    parent: int
    state: str  # "Z" for a zombie
    args: list[bytes]

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
        state, parent = stat.rsplit(")", 1)[1].split()[:2]  # they follow the parenthesised comm, which may hold spaces
        found[int(entry.name)] = Process(int(entry.name), int(parent), state, args)
    return found
