"""A chat session's token transcript: the token-exact bridge between an OpenAI-style message history and the ids a
policy sampled (docs/architecture.md, "Agents and the bridge rule").

The first request's messages (and tools) are rendered by the model's chat template and tokenized once. After that
the transcript only grows: each sampled turn appends the ids the engine sampled (loss mask 1), and each later request
must repeat the session's history exactly and add messages after it. Those new messages are rendered on their own,
with the template's text that follows a sampled turn's end token (Qwen's template writes `<|im_end|>\n`: the model
samples `<|im_end|>`, the `\n` is the template's), and appended with loss mask 0. Sampled text is never tokenized
again: a history that does not extend the session's is refused, never rendered anew.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from jetroll.shared.model.chat import render_chat
from jetroll.shared.model.tokenizer import Tokenizer

SENTINEL = "\x00jetroll-sampled-turn\x00"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class HistoryError(ValueError):
    """A request whose messages do not extend the session's history: `index` is the first message that differs."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"messages[{index}] {reason}")
        self.index = index


class TemplateError(ValueError):
    """A chat template that cannot be bridged token-exactly (it rewrites earlier turns, or does not end an assistant
    turn with the eos token)."""


def turn_tail(template: str, tokenizer: Tokenizer) -> str:
    """The text a template writes after an assistant turn's end token: rendered, never sampled."""
    special = tokenizer.special_tokens()
    text = render_chat(template, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}],
                       special, add_generation_prompt=False)
    end = SENTINEL + tokenizer.eos_token
    if text.count(end) != 1:
        raise TemplateError(f"the chat template does not end an assistant turn with the eos token "
                            f"{tokenizer.eos_token!r}, so a sampled turn's end cannot be told from the template's")
    return text[text.index(end) + len(end):]


def parse_assistant(text: str) -> dict[str, Any]:
    """A sampled turn's text as an OpenAI assistant message: each `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` block that parses becomes a `tool_calls` entry; one that does not stays in `content`, as written."""
    calls, content, start = [], [], 0
    for match in TOOL_CALL.finditer(text):
        call = _tool_call(match.group(1))
        if call is None:
            continue
        content.append(text[start:match.start()])
        start = match.end()
        calls.append({"id": f"call_{len(calls)}", "type": "function", "function": call})
    content.append(text[start:])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content).strip() or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(body: str) -> dict[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
        return None
    return {"name": call["name"], "arguments": json.dumps(call["arguments"])}


def _same(sent: dict[str, Any], kept: dict[str, Any]) -> str | None:
    """Why the message a client sent differs from the session's, or None. Tool calls compare by name and parsed
    arguments (a client may re-serialize them); their ids are the client's to echo or not."""
    if sent.get("role") != kept["role"]:
        return f"has role {sent.get('role')!r} where the session has {kept['role']!r}"
    if (sent.get("content") or None) != (kept.get("content") or None):
        return f"has other content than the session's {kept['role']} message"
    if kept["role"] == "assistant":
        try:
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in sent.get("tool_calls") or []]
        except (KeyError, TypeError, ValueError):
            return "has tool_calls that are not {function: {name, arguments}} with JSON arguments"
        if calls != [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in kept.get("tool_calls", [])]:
            return "has other tool_calls than the session's sampled turn"
    return None


@dataclass
class Transcript:
    """One session's messages and tokens. `ids[i]` was sampled by the policy iff `loss_mask[i]` is 1."""

    template: str
    tokenizer: Tokenizer
    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]  # the history a client must repeat: its messages and the sampled turns
    tail: str  # what the template writes after a sampled turn's end token (`turn_tail`)
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    num_prompt: int = 0  # tokens of the first request's rendering

    @classmethod
    def start(cls, template: str, tokenizer: Tokenizer, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None = None) -> Transcript:
        if not messages:
            raise HistoryError(0, "is missing: a session starts with at least one message")
        tail = turn_tail(template, tokenizer)
        ids = tokenizer.encode(render_chat(template, messages, tokenizer.special_tokens(), tools=tools))
        return cls(template, tokenizer, tools, list(messages), tail, ids, [0] * len(ids), len(ids))

    def add_sampled(self, ids: list[int]) -> dict[str, Any]:
        """Append a sampled turn's ids (its end token included, if it sampled one) and return it as the assistant
        message the client gets and must send back: with its tool calls parsed when the session has tools."""
        self.ids += ids
        self.loss_mask += [1] * len(ids)
        text = self.tokenizer.decode(ids[:-1] if ids and ids[-1] == self.tokenizer.eos_id else ids)
        message = parse_assistant(text) if self.tools else {"role": "assistant", "content": text}
        self.messages.append(message)
        return message

    def extend(self, messages: list[dict[str, Any]]) -> list[int]:
        """Check that `messages` repeats the session's history and adds to it; append the rendering of what it adds
        (loss mask 0) and return those ids, which end with the template's generation prompt."""
        new, added = self.rendering(messages)
        self.append(new, added)
        return added

    def append(self, new: list[dict[str, Any]], added: list[int]) -> None:
        """Append messages and their ids, as `rendering` gave them."""
        self.ids += added
        self.loss_mask += [0] * len(added)
        self.messages += new

    def rendering(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
        """What `extend` would append, checked, without appending it: (the new messages, their ids)."""
        if self.loss_mask[-1] != 1:
            raise ValueError("a session's history is extended only after a sampled turn")
        for index, kept in enumerate(self.messages):
            if index >= len(messages):
                raise HistoryError(index, f"is missing: the session's history has {len(self.messages)} messages")
            reason = _same(messages[index], kept)
            if reason is not None:
                raise HistoryError(index, reason)
        new = messages[len(self.messages):]
        if not new:
            raise HistoryError(len(messages), "is missing: a request adds at least one message after the session's "
                                              "last turn")
        for index, message in enumerate(new, len(self.messages)):
            if message.get("role") == "assistant":
                raise HistoryError(index, "is an assistant message the policy did not sample: the session's turns "
                                          "are sampled, never sent")
        special = self.tokenizer.special_tokens()
        before = render_chat(self.template, self.messages, special, tools=self.tools, add_generation_prompt=False)
        after = render_chat(self.template, self.messages + new, special, tools=self.tools)
        tail = self.tail
        if not after.startswith(before) or not before.endswith(self.tokenizer.eos_token + tail):
            raise TemplateError("the chat template renders the session's history differently once messages follow "
                                "it, so the new messages cannot be appended token-exactly")
        # a turn cut short (max_tokens) sampled no end token: the template's goes in, unsampled
        end = [] if self.ids[-1] == self.tokenizer.eos_id else [self.tokenizer.eos_id]
        return new, end + self.tokenizer.encode(after[len(before) - len(tail):])
