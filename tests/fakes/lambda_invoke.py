"""A fake of AWS Lambda's cloud side: the Invoke API on 127.0.0.1, serving jetroll's real handlers.

`POST /2015-03-31/functions/{name}/invocations` (RequestResponse) runs the handler in a warm execution environment:
a spawned process that serves one invocation at a time, as Lambda's do. Answers follow Lambda:
- 200 and the handler's JSON;
- 200 with `X-Amz-Function-Error: Unhandled` and {errorMessage, errorType, stackTrace} when the handler raises,
  or with "Task timed out after N seconds" when it overruns the function timeout (that environment is killed);
- 429 TooManyRequestsException while all `concurrency` environments of the function are busy;
- 404 ResourceNotFoundException for an unknown function.
`GET /_local/stats` returns handler runs per function and traj_id, and throttles per function.

Tests start it in process (`LocalLambda`); from a source checkout, `python tests/fakes/lambda_invoke.py --port 9001`
serves it for `jetroll bench reward --lambda-endpoint` or a job's `reward.lambda_endpoint_url`. It prints
{"url": ...} on its first stdout line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import unquote

from jetroll.functions.runner import MODULES_ENV

DEFAULT_FUNCTION = "jetroll-reward"
DEFAULT_HANDLER = "jetroll.functions.lambda_handler.handler"
INIT_TIMEOUT_S = 10.0  # Lambda's init phase limit
_INVOKE_PATH = re.compile(r"^/2015-03-31/functions/([^/]+)/invocations$")
_CTX = mp.get_context("spawn")


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One served function: its handler (`module.attr`), timeout, reserved concurrency and extra reward modules."""

    handler: str = DEFAULT_HANDLER
    timeout_s: float = 10.0
    concurrency: int = 8
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.concurrency < 1:
            raise ValueError(f"need timeout_s > 0 and concurrency >= 1, got {self.timeout_s}, {self.concurrency}")


class _Context:
    """The slice of Lambda's context object that handlers use."""

    def __init__(self, function_name: str, request_id: str, deadline: float) -> None:
        self.function_name = function_name
        self.aws_request_id = request_id
        self._deadline = deadline

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.time()) * 1000))


def _environment_main(conn: Connection, function_name: str, spec: FunctionSpec) -> None:
    """One execution environment: cold start (import the handler), then one invocation at a time until EOF."""
    os.environ[MODULES_ENV] = ",".join(spec.modules)  # read by the handler module at import
    module_name, _, attr = spec.handler.rpartition(".")
    handler = getattr(importlib.import_module(module_name), attr)
    conn.send(("ready", b""))
    while True:
        try:
            request_id, payload = conn.recv()
        except EOFError:
            return
        context = _Context(function_name, request_id, time.time() + spec.timeout_s)
        try:
            reply = ("ok", json.dumps(handler(json.loads(payload), context)).encode())
        except Exception as exc:  # reported to the caller as an Unhandled function error, as Lambda does
            error = {"errorMessage": str(exc), "errorType": type(exc).__name__,
                     "stackTrace": traceback.format_exc().splitlines()}
            reply = ("error", json.dumps(error).encode())
        conn.send(reply)


class _Environment:
    def __init__(self, function_name: str, spec: FunctionSpec) -> None:
        self.spec = spec
        self.conn, child = _CTX.Pipe(duplex=True)
        self.process = _CTX.Process(target=_environment_main, args=(child, function_name, spec), daemon=True,
                                    name=f"lambda-env-{function_name}")
        self.process.start()
        child.close()  # so the environment's death shows up as EOF here
        self.is_ready = False

    def invoke(self, request_id: str, payload: bytes) -> tuple[str, bytes]:
        """("ok" | "error", body), ("timeout", b"") past the function timeout, ("died", b"") if the process exits."""
        try:
            if not self.is_ready:
                if not self.conn.poll(INIT_TIMEOUT_S):
                    return "died", b""
                self.conn.recv()
                self.is_ready = True
            self.conn.send((request_id, payload))
            if not self.conn.poll(self.spec.timeout_s):
                return "timeout", b""
            return self.conn.recv()
        except (EOFError, OSError):
            return "died", b""

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class LocalLambda:
    """The endpoint: a ThreadingHTTPServer on 127.0.0.1 plus, per function, up to `concurrency` environments."""

    def __init__(self, functions: Mapping[str, FunctionSpec] | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.functions = dict(functions) if functions else {DEFAULT_FUNCTION: FunctionSpec()}
        self.host, self.port = host, port
        self.invocations: Counter[tuple[str, str]] = Counter()  # (function, traj_id) -> handler runs
        self.throttles: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Environment]] = {name: [] for name in self.functions}
        self._num_envs: Counter[str] = Counter()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "LocalLambda is not started"
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> LocalLambda:
        endpoint = self

        class Handler(_InvokeHandler):
            lambda_ = endpoint

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-lambda", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            envs = [env for idle in self._idle.values() for env in idle]
            for idle in self._idle.values():
                idle.clear()
        for env in envs:
            env.kill()

    def __enter__(self) -> LocalLambda:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            runs: dict[str, dict[str, int]] = {}
            for (function, traj_id), count in self.invocations.items():
                runs.setdefault(function, {})[traj_id] = count
            return {"invocations": runs, "throttles": dict(self.throttles)}

    def _acquire(self, name: str) -> _Environment | None:
        with self._lock:
            if self._idle[name]:
                return self._idle[name].pop()
            if self._num_envs[name] >= self.functions[name].concurrency:
                self.throttles[name] += 1
                return None
            self._num_envs[name] += 1
        try:
            return _Environment(name, self.functions[name])
        except BaseException:
            with self._lock:
                self._num_envs[name] -= 1
            raise

    def _release(self, name: str, env: _Environment, is_healthy: bool) -> None:
        if not is_healthy:
            env.kill()
        with self._lock:
            if is_healthy and self._server is not None:
                self._idle[name].append(env)
                return
            self._num_envs[name] -= 1
        if is_healthy:
            env.kill()  # stopped meanwhile

    def invoke(self, name: str, payload: bytes) -> tuple[int, dict[str, str], bytes]:
        """One invocation: (HTTP status, headers, body), exactly what the endpoint answers."""
        request_id = str(uuid.uuid4())
        if name not in self.functions:
            return _error(404, "ResourceNotFoundException", f"Function not found: {name}", request_id)
        try:
            event = json.loads(payload or b"{}")
        except ValueError:
            return _error(400, "InvalidRequestContentException", "Could not parse request body into json",
                          request_id)
        env = self._acquire(name)
        if env is None:
            return _error(429, "TooManyRequestsException", "Rate Exceeded.", request_id,
                          Reason="ReservedFunctionConcurrentInvocationLimitExceeded")
        traj_id = str(event.get("traj_id", "")) if isinstance(event, dict) else ""
        with self._lock:
            self.invocations[(name, traj_id)] += 1
        kind, body = env.invoke(request_id, payload or b"{}")
        self._release(name, env, is_healthy=kind in ("ok", "error"))
        headers = {"x-amzn-RequestId": request_id, "X-Amz-Executed-Version": "$LATEST",
                   "Content-Type": "application/json"}
        if kind == "ok":
            return 200, headers, body
        headers["X-Amz-Function-Error"] = "Unhandled"
        if kind == "timeout":
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            message = f"{stamp} {request_id} Task timed out after {self.functions[name].timeout_s:.2f} seconds"
            body = json.dumps({"errorMessage": message, "errorType": "Sandbox.Timedout"}).encode()
        elif kind == "died":
            message = f"RequestId: {request_id} Error: Runtime exited with error: exit status {env.process.exitcode}"
            body = json.dumps({"errorMessage": message, "errorType": "Runtime.ExitError"}).encode()
        return 200, headers, body


def _error(status: int, error_type: str, message: str, request_id: str,
           **extra: str) -> tuple[int, dict[str, str], bytes]:
    headers = {"x-amzn-RequestId": request_id, "x-amzn-ErrorType": error_type, "Content-Type": "application/json"}
    return status, headers, json.dumps({"Type": "User", "message": message, **extra}).encode()


def _function_name(raw: str) -> str:
    """A name, `name:qualifier` or a function ARN (`arn:aws:lambda:region:account:function:name[:qualifier]`)."""
    parts = unquote(raw).split(":")
    if parts[0] == "arn" and len(parts) >= 7:
        return parts[6]
    return parts[0]


class _InvokeHandler(BaseHTTPRequestHandler):
    lambda_: LocalLambda
    protocol_version = "HTTP/1.1"  # keep-alive, as botocore's connection pool expects
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

    def do_POST(self) -> None:
        payload = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        match = _INVOKE_PATH.match(self.path.split("?", 1)[0])
        invocation_type = self.headers.get("X-Amz-Invocation-Type", "RequestResponse")
        if match is None:
            self._send(*_error(404, "UnknownOperationException", f"no route {self.path}", str(uuid.uuid4())))
        elif invocation_type != "RequestResponse":
            self._send(*_error(400, "InvalidParameterValueException",
                               f"only RequestResponse invocations are served, got {invocation_type}",
                               str(uuid.uuid4())))
        else:
            self._send(*self.lambda_.invoke(_function_name(match.group(1)), payload))

    def do_GET(self) -> None:
        if self.path == "/_local/stats":
            self._send(200, {"Content-Type": "application/json"}, json.dumps(self.lambda_.stats()).encode())
        else:
            self._send(*_error(404, "UnknownOperationException", f"no route {self.path}", str(uuid.uuid4())))

    def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass  # one line per request would drown the bench


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="local AWS Lambda Invoke endpoint for jetroll's reward handlers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--function", action="append", default=[], metavar="NAME[=MODULE.HANDLER]",
                        help=f"a served function (repeatable; default {DEFAULT_FUNCTION}={DEFAULT_HANDLER})")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="function timeout")
    parser.add_argument("--concurrency", type=int, default=8, help="environments per function; more get 429")
    parser.add_argument("--modules", default="", help="comma-separated extra reward modules")
    args = parser.parse_args(argv)
    modules = tuple(m for m in args.modules.split(",") if m)
    specs = {}
    for item in args.function or [DEFAULT_FUNCTION]:
        name, _, handler = item.partition("=")
        specs[name] = FunctionSpec(handler or DEFAULT_HANDLER, args.timeout_s, args.concurrency, modules)
    endpoint = LocalLambda(specs, args.host, args.port).start()
    print(json.dumps({"url": endpoint.url}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    endpoint.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
