"""An agent's episode on the gateway: a session, the `TokenEnvironment` the turn runner drives
(shared/engine/turns.py), and the rules each of its requests must keep (docs in shared/agents/gateway.py).

Its reset returns the ids of the agent's first request; each sampled turn answers the request that waits on it, and
the agent's next request becomes the observation, rendered by the bridge rule (shared/model/transcript.py), never
re-tokenized. The agent's end (shared/agents/wire.py) ends the episode.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from jetroll.shared.agents.wire import ROLES, EpisodeOutcome
from jetroll.shared.engine.request import Request
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.model.transcript import HistoryError, TemplateError, Transcript
from jetroll.shared.tasks.env import EnvStep


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


@dataclass(frozen=True)
class SessionRules:
    """What every session of one gateway renders with and holds its requests to."""

    tokenizer: Tokenizer
    max_len: int  # the model's context
    temperature: float  # the job's: a request may repeat it, not change it
    top_p: float
    model_name: str

    @property
    def template(self) -> str:
        assert self.tokenizer.chat_template is not None, "the gateway checks for a chat template"
        return self.tokenizer.chat_template

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


class Session:
    """One episode's conversation: a `TokenEnvironment` of the turn runner. `deadline_s` bounds the whole session
    from its reset: past it, the episode ends with env status `timeout` (its group is dropped, counted), so that no
    agent holds a group, and the trainer's staleness wait, longer than that."""

    def __init__(self, rules: SessionRules, url: str, session_id: str, budget: int, deadline_s: float,
                 on_close: Callable[[Session], None]) -> None:
        self.rules = rules
        self.url = url  # the API base its agent is handed
        self.session_id = session_id
        self.on_close = on_close
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
        self.failure: BaseException | None = None
        self.ended: str | None = None

    # the turn runner's side

    async def reset(self, problem: object) -> list[int]:
        """The agent's first request (its problem is the agent's: whoever opened the session launched it)."""
        if self.deadline == math.inf:  # a retried reset waits again, on the same deadline
            self.deadline = time.monotonic() + self.deadline_s
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
        self.on_close(self)

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
        outcome = EpisodeOutcome.parse(call.body)  # the gateway took it: a body it refuses never gets here
        status, reason = outcome.status, outcome.reason
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
        self.rules.check_sampling(call.body, self.budget - self.num_output)
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
            transcript = Transcript.start(self.rules.template, self.rules.tokenizer, messages, tools)
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
            ids = self.rules.tokenizer.encode(prompt)
            self._check_prompt(len(ids))
        elif not prompt.startswith(self.text) or len(prompt) == len(self.text):
            index = next((i for i, (a, b) in enumerate(zip(prompt, self.text, strict=False)) if a != b),
                         min(len(prompt), len(self.text)))
            raise GatewayError(400, "history_mismatch", f"prompt differs from the session's text at character "
                               f"{index}: a later prompt repeats the session's text (prompts and completions) and "
                               "adds to it")
        else:
            ids = self.rules.tokenizer.encode(prompt[len(self.text):])
        self.text = prompt
        return ids

    def _check_prompt(self, num_tokens: int) -> None:
        if num_tokens >= self.rules.max_len - 1:
            raise GatewayError(400, "context_length_exceeded", f"the first request renders to {num_tokens} tokens: "
                               f"the model's context is {self.rules.max_len}, and a turn needs room")

    def _answer(self, request: Request, turn_ids: list[int], finish: str) -> None:
        """Answer the waiting request with a sampled turn (recorded in the session first)."""
        assert self.pending is not None, "a sampled turn answers the request it was sampled for"
        call, self.pending = self.pending, None
        start = len(request.output_ids) - len(turn_ids)
        logprobs, versions = request.logprobs[start:], request.versions[start:]
        self.num_output += len(turn_ids)
        self.num_turns += 1
        tokenizer = self.rules.tokenizer
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
            "object": kind, "created": int(time.time()), "model": self.rules.model_name, "choices": [choice],
            "usage": {"prompt_tokens": num_prompt, "completion_tokens": len(turn_ids),
                      "total_tokens": num_prompt + len(turn_ids)},
            # jetroll's own: the turn as the engine sampled it, and the weight version of each token
            "token_ids": turn_ids, "weight_versions": versions}))
