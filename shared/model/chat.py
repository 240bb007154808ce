"""Chat templates: a task's prompt as the model's template renders it, the way transformers' `apply_chat_template`
does (a sandboxed Jinja environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`, a `tojson`
that does not escape HTML, `strftime_now`, and the tokenizer's special tokens as variables).

The rendered text is tokenized once, special tokens included (a template's `{{ bos_token }}` becomes the BOS id);
everything after the prompt is appended as token ids, never re-tokenized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from jetroll.shared.config.model import ModelConfig
from jetroll.shared.errors import ConfigError
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.tasks.base import Problem


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, Any]], special_tokens: dict[str, str], *,
                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
    """`messages` (OpenAI's chat format: assistant turns may carry `tool_calls`, tool results are `tool` messages)
    and `tools` (OpenAI's function specs), rendered as the template writes them."""
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                      tools=tools or None, documents=None, **special_tokens)


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """How a problem becomes token ids: its prompt as it is, or (`model.chat_template: true`) its chat messages (a
    dataset's) or its prompt as a user message, after `model.system_prompt` if any, rendered by the model's chat
    template with the generation prompt."""

    tokenizer: Tokenizer
    template: str | None = None
    system_prompt: str | None = None

    @classmethod
    def of(cls, config: ModelConfig, tokenizer: Tokenizer) -> PromptFormat:
        if not config.chat_template:
            return cls(tokenizer)
        if tokenizer.chat_template is None:
            raise ConfigError(f"model.chat_template is true, but the model at {config.path} ships no chat template "
                              "(tokenizer_config.json's chat_template, or chat_template.jinja)")
        return cls(tokenizer, tokenizer.chat_template, config.system_prompt)

    def text(self, problem: Problem) -> str:
        """The prompt as the model reads it: a problem's chat messages through the template (after the system
        prompt, unless they bring their own), else its prompt (as a user message when there is a template)."""
        if self.template is None:
            if problem.messages is not None:
                raise ConfigError("a problem with chat messages needs model.chat_template: true")
            return problem.prompt
        return render_chat(self.template, self.messages(problem), self.tokenizer.special_tokens())

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The chat messages the template renders: the problem's own, or its prompt as a user message, after the
        system prompt unless they bring their own."""
        messages = list(problem.messages or [("user", problem.prompt)])
        if self.system_prompt and messages[0][0] != "system":
            messages.insert(0, ("system", self.system_prompt))
        return [{"role": role, "content": content} for role, content in messages]

    def ids(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode(self.text(problem))
