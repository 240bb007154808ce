"""The agents' gateway: an OpenAI-compatible HTTP server in front of an engine, one session per episode
(docs/architecture.md, "Agents and the bridge rule"), at the routes of shared/agents/wire.py.

An agent program talks to its session's API base (`wire.session_url`) with any OpenAI client: `chat/completions`
(messages and tools, through the model's chat template) or `completions` (raw text). Whoever opens a session launches
its agent (the rollout worker publishes an episode event; an evaluation runs it inline). A session
(shared/agents/session.py) is a `TokenEnvironment` of the turn runner; the agent's side ends it with the end body of
wire.py, and then the turn runner ends the episode and the rollout worker emits its trajectory.

Rules a request must keep (each broken one is a 4xx naming it, and the session goes on):
- one request at a time per session; `n` 1; no streaming;
- `temperature` and `top_p`, when given, are the job's (`rollout.temperature`, `rollout.top_p`): a trajectory carries
  one of each, and the trainer's loss is computed at them;
- `stop` strings are refused: the engines stop on token ids (the template's end of turn);
- `max_tokens` (or `max_completion_tokens`), when given, is at least the session's remaining token budget: the
  engines stop a sequence on its whole budget (the task's `max_new_tokens`), not per turn;
- `tools` are fixed by the first request; `tool_choice` is `auto` or absent; `top_logprobs` 0 or absent;
- a session is chat or text, as its first request was;
- a request past the model's context gets 400 `context_length_exceeded`; the episode ends there.
An unknown session is 404, an ended one 410, a malformed body 400, one over `max_request_bytes` 413.
"""

from __future__ import annotations

import json
import logging
import socket
from collections import OrderedDict
from typing import Any

from aiohttp import web

from jetroll.shared.agents.session import Call, GatewayError, Session, SessionRules
from jetroll.shared.agents.wire import (
    CHAT_KEYS,
    CHAT_ROUTE,
    COMPLETION_KEYS,
    COMPLETIONS_ROUTE,
    END_KEYS,
    END_ROUTE,
    HEALTH_ROUTE,
    BadEnd,
    EpisodeOutcome,
    session_url,
)
from jetroll.shared.model.tokenizer import Tokenizer

log = logging.getLogger("jetroll.gateway")
ENDED_KEPT = 4096  # ended sessions remembered, so that a late request gets 410 rather than 404


class Gateway:
    """The HTTP server: sessions by id on 127.0.0.1 (or `host`), on the caller's event loop."""

    def __init__(self, tokenizer: Tokenizer, max_len: int, temperature: float, top_p: float, *,
                 model_name: str = "jetroll-policy", host: str = "127.0.0.1", port: int = 0,
                 max_request_bytes: int = 1 << 20) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the gateway needs a model with a chat template (its chat sessions render messages "
                             "with it)")
        self.rules = SessionRules(tokenizer, max_len, temperature, top_p, model_name)
        self.host = host
        self.port = port
        self.max_request_bytes = max_request_bytes
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=self.max_request_bytes)
        app.add_routes([web.post(CHAT_ROUTE, self._chat), web.post(COMPLETIONS_ROUTE, self._text),
                        web.post(END_ROUTE, self._end), web.get(HEALTH_ROUTE, self._health)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # port 0: the one bound
        # bound to every interface, it is reached at this machine's address (a container's, in compose)
        host = socket.gethostbyname(socket.gethostname()) if self.host == "0.0.0.0" else self.host
        self.url = f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            if session.pending is not None:
                session.pending.refuse(GatewayError(503, "gateway_closing", "the gateway is shutting down"))
        if self._runner is not None:
            await self._runner.cleanup()

    def open(self, session_id: str, budget: int, deadline_s: float) -> Session:
        """A new session, at `session.url` once the gateway has started; its opener launches its agent there. A
        session id in use is a bug of the caller (ids are trajectory ids)."""
        if session_id in self.sessions:
            raise ValueError(f"session {session_id} is already open")
        self.ended.pop(session_id, None)  # a group reclaimed after a restart opens its ids again
        session = Session(self.rules, session_url(self.url, session_id), session_id, budget, deadline_s, self.forget)
        self.sessions[session_id] = session
        return session

    def forget(self, session: Session) -> None:
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        self.ended[session.session_id] = session.ended or "ended"
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "sessions": len(self.sessions)})

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._call(request, "chat", CHAT_KEYS)

    async def _text(self, request: web.Request) -> web.Response:
        return await self._call(request, "text", COMPLETION_KEYS)

    async def _end(self, request: web.Request) -> web.Response:
        return await self._call(request, "end", END_KEYS)

    async def _call(self, request: web.Request, kind: str, keys: frozenset[str]) -> web.Response:
        session_id = request.match_info["session_id"]
        try:
            session = self._session(session_id)
            body = await self._body(request, keys)
            if kind == "end":
                try:
                    EpisodeOutcome.parse(body)
                except BadEnd as bad:
                    raise GatewayError(400, bad.code, str(bad)) from None
            elif session.num_waiting:
                raise GatewayError(409, "request_in_flight", f"session {session_id} already has a request in "
                                   "flight: one at a time")
        except GatewayError as error:
            return error.response()
        call = Call(kind, body)
        session.inbox.put_nowait(call)
        session.num_waiting += kind != "end"
        try:
            return await call.answer
        finally:
            session.num_waiting -= kind != "end"

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is not None and session.ended is None:
            return session
        if session_id in self.ended:
            raise GatewayError(410, "session_ended", f"session {session_id} has ended: {self.ended[session_id]}")
        raise GatewayError(404, "unknown_session", f"no session {session_id} on this gateway")

    async def _body(self, request: web.Request, keys: frozenset[str]) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(413, "request_too_large", f"a request is at most {self.max_request_bytes} "
                               "bytes") from None
        except ValueError as exc:
            raise GatewayError(400, "invalid_json", f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "invalid_json", "the body must be a JSON object")
        unknown = sorted(set(body) - keys)
        if unknown:
            raise GatewayError(400, "unsupported_parameter", f"unsupported parameter(s) {unknown}; this endpoint "
                               f"takes {sorted(keys)}")
        return body
