"""The agents' gateway: an OpenAI-compatible HTTP server in front of an engine, one session per episode
(docs/architecture.md, "Agents and the bridge rule").

An agent program talks to `{url}/sessions/{session_id}/v1` with any OpenAI client: `chat/completions` (messages and
tools, through the model's chat template) or `completions` (raw text). A session is a `TokenEnvironment` of the turn
runner (shared/engine/turns.py): its reset launches the agent and returns the ids of its first request; each sampled
turn answers the request that waits on it, and the agent's next request becomes the observation, rendered by the
bridge rule (shared/model/transcript.py), never re-tokenized. The agent's side ends the session with
`POST {url}/sessions/{session_id}/end` and its outcome; then the turn runner ends the episode and the rollout worker
emits its trajectory.

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

import asyncio
import json
import logging
import math
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from jetroll.shared.engine.request import Request
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.model.transcript import HistoryError, TemplateError, Transcript
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.env import EnvStep

log = logging.getLogger("jetroll.gateway")

ROLES = frozenset({"system", "user", "assistant", "tool"})
CHAT_KEYS = frozenset({"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
                       "max_completion_tokens", "stop", "logprobs", "top_logprobs", "n", "stream", "user"})
COMPLETION_KEYS = frozenset({"model", "prompt", "temperature", "top_p", "max_tokens", "stop", "logprobs", "n",
                             "stream", "user", "echo"})
END_STATUSES = frozenset({"ok", "error", "timeout"})
ENDED_KEPT = 4096  # ended sessions remembered, so that a late request gets 410 rather than 404


class GatewayError(Exception):
    """A request the gateway refuses: its HTTP status, an OpenAI-style error code and the reason."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": str(self), "type": "invalid_request_error",
                                            "code": self.code}}, status=self.status)


class AgentFailed(RuntimeError):
    """The agent's side ended its session with `error`: its reason."""


@dataclass(slots=True)
class Call:
    """One HTTP request to a session, waiting for its answer."""

    kind: str  # chat | text | end
    body: dict[str, Any]
    answer: asyncio.Future[web.Response] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def reply(self, response: web.Response) -> None:
        if not self.answer.done():
            self.answer.set_result(response)

    def refuse(self, error: GatewayError) -> None:
        self.reply(error.response())


Launch = Callable[["Session", Problem], Awaitable[None]]


class Session:
    """One episode's conversation: a `TokenEnvironment` of the turn runner. `deadline_s` bounds the whole session
    from its reset: past it, the episode ends with env status `timeout` (its group is dropped, counted), so that no
    agent holds a group, and the trainer's staleness wait, longer than that."""

    def __init__(self, gateway: Gateway, session_id: str, launch: Launch, budget: int, deadline_s: float) -> None:
        self.gateway = gateway
        self.session_id = session_id
        self.launch = launch
        self.budget = budget  # tokens after the prompt: sampled turns and observations
        self.deadline_s = deadline_s
        self.deadline = math.inf
        self.inbox: asyncio.Queue[Call] = asyncio.Queue()
        self.kind: str | None = None  # chat | text, from the first request
        self.transcript: Transcript | None = None
        self.text = ""  # a text session: everything the client has seen, prompt and completions
        self.num_prompt = 0
        self.num_output = 0  # tokens after the prompt the session has accounted for (request.output_ids[:n])
        self.pending: Call | None = None  # the request whose turn the engine is sampling
        self.num_waiting = 0  # requests (not ends) sent and not yet answered: at most one
        self.turn_answered_at = -1  # turn_start of the turn already answered (a retried step answers it once)
        self.num_turns = 0
        self.is_launched = False
        self.failure: BaseException | None = None
        self.ended: str | None = None

    @property
    def url(self) -> str:
        return f"{self.gateway.url}/sessions/{self.session_id}/v1"

    # the turn runner's side

    async def reset(self, problem: Problem) -> list[int]:
        if not self.is_launched:  # a retried reset waits again, it never launches a second agent
            self.is_launched = True
            self.deadline = time.monotonic() + self.deadline_s
            await self.launch(self, problem)
        call, ids = await self._next()
        if call.kind == "end":
            raise self._ended_by(call, before_first=True)
        self.pending = call
        return ids

    async def step_tokens(self, request: Request, turn_start: int) -> EnvStep:
        if self.turn_answered_at != turn_start:
            self.turn_answered_at = turn_start
            self._answer(request, request.output_ids[turn_start:], "stop")
        call, ids = await self._next()
        if call.kind == "end":
            failure = self._ended_by(call, before_first=False)
            if failure is not None:
                raise failure
            return EnvStep(done=True, reward=call.body.get("reward"))
        self.pending = call
        return EnvStep(observation_ids=ids)

    def close(self, request: Request) -> None:
        """The episode ended: answer a client still waiting, refuse what is queued, forget the session."""
        reason = f"session {self.session_id} ended ({request.finish_reason or 'env ' + self._failure_status()})"
        if self.pending is not None:
            partial = request.output_ids[self.num_output:]
            if request.finish_reason == "length" and partial:
                self._answer(request, partial, "length")
            elif request.finish_reason == "length":
                self.pending.refuse(GatewayError(400, "context_length_exceeded", "this request does not fit the "
                                                 f"model's context or the session's budget of {self.budget} tokens"))
            else:
                self.pending.refuse(GatewayError(410, "session_ended", reason))
        while not self.inbox.empty():
            call = self.inbox.get_nowait()
            if call.kind == "end":
                call.reply(web.json_response({"ended": True, "note": reason}))
            else:
                call.refuse(GatewayError(410, "session_ended", reason))
        self.ended = reason
        self.gateway.forget(self)

    def _failure_status(self) -> str:
        return "timeout" if isinstance(self.failure, TimeoutError) else "error"

    async def _next(self) -> tuple[Call, list[int]]:
        """The client's next request that the session accepts (refused ones are answered and skipped), or its end."""
        if self.failure is not None:
            raise self.failure
        while True:
            remaining = self.deadline - time.monotonic()
            try:
                call = await asyncio.wait_for(self.inbox.get(), max(remaining, 0))
            except TimeoutError:
                self.failure = TimeoutError(f"session {self.session_id} ran past its {self.deadline_s:g} s deadline")
                raise self.failure from None
            if call.kind == "end":
                return call, []
            try:
                return call, self._accept(call)
            except GatewayError as error:
                call.refuse(error)
            except (HistoryError, TemplateError) as error:
                call.refuse(GatewayError(400, "history_mismatch", str(error)))

    def _ended_by(self, call: Call, before_first: bool) -> BaseException | None:
        """The agent's end, as the episode's outcome: None when it ended well, else the failure the turn runner
        records as the env status (`timeout` or `error`), never a reward."""
        status, reason = call.body["status"], call.body.get("reason") or ""
        if status == "ok" and before_first:
            status, reason = "error", "the agent ended its session before any request"
        call.reply(web.json_response({"ended": True}))
        if status == "ok":
            return None
        self.failure = (TimeoutError if status == "timeout" else AgentFailed)(reason or f"the agent ended {status}")
        return self.failure

    # the requests

    def _accept(self, call: Call) -> list[int]:
        """Check a request against the rules and record it; returns the ids it appends (the whole prompt for the
        first). A later request that does not fit goes in all the same: the turn runner ends the episode on it by
        its length rule, and `close` answers it 400 `context_length_exceeded`."""
        if self.kind is not None and call.kind != self.kind:
            raise GatewayError(400, "wrong_endpoint", f"this is a {self.kind} session: its first request chose it")
        self.gateway.check_sampling(call.body, self.budget - self.num_output)
        if call.kind == "chat":
            ids = self._chat(call.body)
        else:
            ids = self._text(call.body)
        if self.kind is None:
            self.kind, self.num_prompt = call.kind, len(ids)
        else:
            self.num_output += len(ids)
        return ids

    def _chat(self, body: dict[str, Any]) -> list[int]:
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content") or "", str)
                for m in messages):
            raise GatewayError(400, "invalid_messages", "messages must be a list of {role, content} with role one of "
                               f"{sorted(ROLES)} and string content")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise GatewayError(400, "invalid_tools", "tools must be a list of OpenAI function specs")
        if body.get("tool_choice") not in (None, "auto"):
            raise GatewayError(400, "unsupported_parameter", "tool_choice must be 'auto' or absent: the policy "
                               "chooses its own calls")
        if self.transcript is None:
            transcript = Transcript.start(self.gateway.template, self.gateway.tokenizer, messages, tools)
            self._check_prompt(len(transcript.ids))
            self.transcript = transcript
            return list(transcript.ids)
        if (tools or None) != (self.transcript.tools or None):
            raise GatewayError(400, "tools_changed", "tools are fixed by a session's first request")
        new, ids = self.transcript.rendering(messages)
        self.transcript.append(new, ids)
        return ids

    def _text(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise GatewayError(400, "invalid_prompt", "prompt must be a non-empty string")
        if body.get("echo"):
            raise GatewayError(400, "unsupported_parameter", "echo is not supported")
        if self.kind is None:
            ids = self.gateway.tokenizer.encode(prompt)
            self._check_prompt(len(ids))
        elif not prompt.startswith(self.text) or len(prompt) == len(self.text):
            index = next((i for i, (a, b) in enumerate(zip(prompt, self.text, strict=False)) if a != b),
                         min(len(prompt), len(self.text)))
            raise GatewayError(400, "history_mismatch", f"prompt differs from the session's text at character "
                               f"{index}: a later prompt repeats the session's text (prompts and completions) and "
                               "adds to it")
        else:
            ids = self.gateway.tokenizer.encode(prompt[len(self.text):])
        self.text = prompt
        return ids

    def _check_prompt(self, num_tokens: int) -> None:
        if num_tokens >= self.gateway.max_len - 1:
            raise GatewayError(400, "context_length_exceeded", f"the first request renders to {num_tokens} tokens: "
                               f"the model's context is {self.gateway.max_len}, and a turn needs room")

    def _answer(self, request: Request, turn_ids: list[int], finish: str) -> None:
        """Answer the waiting request with a sampled turn (recorded in the session first)."""
        assert self.pending is not None, "a sampled turn answers the request it was sampled for"
        call, self.pending = self.pending, None
        start = len(request.output_ids) - len(turn_ids)
        logprobs, versions = request.logprobs[start:], request.versions[start:]
        self.num_output += len(turn_ids)
        self.num_turns += 1
        tokenizer = self.gateway.tokenizer
        if call.kind == "chat":
            assert self.transcript is not None
            message = self.transcript.add_sampled(turn_ids)
            if finish == "stop" and message.get("tool_calls"):
                finish = "tool_calls"
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            if call.body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": (t := tokenizer.decode([i])), "logprob": lp, "bytes": list(t.encode()),
                     "top_logprobs": []} for i, lp in zip(turn_ids, logprobs, strict=True)]}
            kind = "chat.completion"
        else:
            text = tokenizer.decode(turn_ids[:-1] if turn_ids and turn_ids[-1] == tokenizer.eos_id else turn_ids)
            self.text += text
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            if call.body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": [tokenizer.decode([i]) for i in turn_ids],
                                      "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}
            kind = "text_completion"
        num_prompt = self.num_prompt + self.num_output - len(turn_ids)
        call.reply(web.json_response({
            "id": f"{'chatcmpl' if call.kind == 'chat' else 'cmpl'}-{self.session_id}-{self.num_turns}",
            "object": kind, "created": int(time.time()), "model": self.gateway.model_name, "choices": [choice],
            "usage": {"prompt_tokens": num_prompt, "completion_tokens": len(turn_ids),
                      "total_tokens": num_prompt + len(turn_ids)},
            # jetroll's own: the turn as the engine sampled it, and the weight version of each token
            "token_ids": turn_ids, "weight_versions": versions}))


class Gateway:
    """The HTTP server: sessions by id on 127.0.0.1 (or `host`), on the caller's event loop."""

    def __init__(self, tokenizer: Tokenizer, max_len: int, temperature: float, top_p: float, *,
                 model_name: str = "jetroll-policy", host: str = "127.0.0.1", port: int = 0,
                 max_request_bytes: int = 1 << 20) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the gateway needs a model with a chat template (its chat sessions render messages "
                             "with it)")
        self.tokenizer = tokenizer
        self.template = tokenizer.chat_template
        self.max_len = max_len
        self.temperature = temperature
        self.top_p = top_p
        self.model_name = model_name
        self.host = host
        self.port = port
        self.max_request_bytes = max_request_bytes
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=self.max_request_bytes)
        app.add_routes([web.post("/sessions/{session_id}/v1/chat/completions", self._chat),
                        web.post("/sessions/{session_id}/v1/completions", self._text),
                        web.post("/sessions/{session_id}/end", self._end),
                        web.get("/health", self._health)])
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

    def open(self, session_id: str, launch: Launch, budget: int, deadline_s: float) -> Session:
        """A new session; a session id in use is a bug of the caller (ids are trajectory ids)."""
        if session_id in self.sessions:
            raise ValueError(f"session {session_id} is already open")
        self.ended.pop(session_id, None)  # a group reclaimed after a restart opens its ids again
        session = self.sessions[session_id] = Session(self, session_id, launch, budget, deadline_s)
        return session

    def forget(self, session: Session) -> None:
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        self.ended[session.session_id] = session.ended or "ended"
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def check_sampling(self, body: dict[str, Any], remaining: int) -> None:
        """The sampling parameters a request may set, by the rules in the module's docstring."""
        for name, job_value in (("temperature", self.temperature), ("top_p", self.top_p)):
            value = body.get(name)
            if value is not None and (not isinstance(value, int | float) or abs(value - job_value) > 1e-9):
                raise GatewayError(400, "unsupported_parameter", f"{name} {value!r}: this job samples at {name} "
                                   f"{job_value:g} (a trajectory carries one, and the trainer's loss uses it)")
        if body.get("n") not in (None, 1):
            raise GatewayError(400, "unsupported_parameter", "n must be 1: a session is one episode")
        if body.get("stream"):
            raise GatewayError(400, "unsupported_parameter", "streaming is not supported")
        if body.get("stop"):
            raise GatewayError(400, "unsupported_parameter", "stop strings are not supported: the engines stop on "
                               "token ids (the chat template's end of turn)")
        if body.get("top_logprobs"):
            raise GatewayError(400, "unsupported_parameter", "top_logprobs must be 0 or absent: a token records "
                               "only its own log-prob")
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if value is not None and (not isinstance(value, int) or value < remaining):
                raise GatewayError(400, "unsupported_parameter", f"{name} {value!r} is below the session's remaining "
                                   f"budget of {remaining} tokens: the engines stop a sequence on its whole budget, "
                                   "not per turn (leave it out)")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "sessions": len(self.sessions)})

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._call(request, "chat", CHAT_KEYS)

    async def _text(self, request: web.Request) -> web.Response:
        return await self._call(request, "text", COMPLETION_KEYS)

    async def _end(self, request: web.Request) -> web.Response:
        return await self._call(request, "end", frozenset({"status", "reward", "reason"}))

    async def _call(self, request: web.Request, kind: str, keys: frozenset[str]) -> web.Response:
        session_id = request.match_info["session_id"]
        try:
            session = self._session(session_id)
            body = await self._body(request, keys)
            if kind == "end":
                _check_end(body)
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


def _check_end(body: dict[str, Any]) -> None:
    status, reward = body.get("status"), body.get("reward")
    if status not in END_STATUSES:
        raise GatewayError(400, "invalid_status", f"status must be one of {sorted(END_STATUSES)}, not {status!r}")
    if reward is not None and not (isinstance(reward, int | float) and math.isfinite(reward) and 0 <= reward <= 1):
        raise GatewayError(400, "invalid_reward", f"reward must be a number in [0, 1] or null, not {reward!r}")
    if not isinstance(body.get("reason", ""), str):
        raise GatewayError(400, "invalid_reason", "reason must be a string")
