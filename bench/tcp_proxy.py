"""A TCP forwarder on 127.0.0.1 for S3 outages (the chaos bench, the outage tests): cut it and the server behind it
is unreachable, though it keeps running (moto keeps its objects in memory, so stopping moto would lose the store)."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Self


class TcpProxy:
    """Forwards each connection to `target`; `cut()` drops them all and refuses new ones, `restore()` listens again
    on the same port."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._listen()
        return self

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            _close(listener)  # wakes the accept loop, which then ends
        with self._lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            _close(connection)

    def restore(self) -> None:
        assert self._listener is None, "not cut"
        self._listen()

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._connections |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        for end in (source, sink):
            _close(end)
            with self._lock:
                self._connections.discard(end)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
