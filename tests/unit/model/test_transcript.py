"""The bridge rule (shared/model/transcript.py) on both chat templates jetroll ships: bpe-math's (no tools) and
bpe-agent's (Qwen2.5's tool layout). Sampled ids stay as sampled; what follows them is the template's own text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jetroll.shared.model.chat import render_chat
from jetroll.shared.model.tokenizer import Tokenizer, load_tokenizer
from jetroll.shared.model.transcript import HistoryError, TemplateError, Transcript, parse_assistant

REPO = Path(__file__).resolve().parents[3]
CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}
TOOL_TURN = '<tool_call>{"name": "calculator", "arguments": {"expression": "64*16"}}</tool_call>'


@pytest.fixture(params=["bpe-math", "bpe-agent"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return load_tokenizer(REPO / "configs" / "models" / request.param)


def tools_of(tokenizer: Tokenizer) -> list[dict[str, Any]] | None:
    return [CALCULATOR] if "tools" in (tokenizer.chat_template or "") else None


def start(tokenizer: Tokenizer, question: str = "Oli has 64 boxes of 16 stamps. How many stamps?") -> Transcript:
    assert tokenizer.chat_template is not None
    return Transcript.start(tokenizer.chat_template, tokenizer, [{"role": "user", "content": question}],
                            tools_of(tokenizer))


def sampled_as_characters(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` one byte-level token per character: ids that tokenizing the decoded text again would not give."""
    ids = [tokenizer.encode(char)[0] for char in text]
    assert tokenizer.decode(ids) == text and tokenizer.encode(text) != ids
    return ids + [tokenizer.eos_id]


def test_sampled_ids_stay_as_sampled_and_the_new_messages_follow_as_the_template_writes_them(
    tokenizer: Tokenizer,
) -> None:
    transcript = start(tokenizer)
    prompt = list(transcript.ids)
    sampled = sampled_as_characters(tokenizer, "The answer is 1024.")
    message = transcript.add_sampled(sampled)
    assert message == {"role": "assistant", "content": "The answer is 1024."}
    user = {"role": "user", "content": "Are you sure?"}
    added = transcript.extend([*transcript.messages, user])
    assert transcript.ids == prompt + sampled + added
    assert transcript.loss_mask == [0] * len(prompt) + [1] * len(sampled) + [0] * len(added)
    # the bridge is the template's text after the sampled end token: its newline, the user turn, the generation prompt
    special = tokenizer.special_tokens()
    messages = transcript.messages
    full = render_chat(tokenizer.chat_template, messages, special, tools=tools_of(tokenizer))
    assert tokenizer.backend.decode(added, skip_special_tokens=False) == full.split(
        "The answer is 1024." + tokenizer.eos_token, 1)[1]


def test_a_turn_sampled_as_the_tokenizer_would_write_it_gives_the_templates_own_tokens(tokenizer: Tokenizer) -> None:
    """Every turn, sampled or rendered, in canonical tokens: the transcript equals the whole conversation rendered
    and tokenized at once, tool calls and results included."""
    transcript = start(tokenizer)
    transcript.add_sampled(tokenizer.encode(TOOL_TURN) + [tokenizer.eos_id])
    transcript.extend([*transcript.messages, {"role": "tool", "tool_call_id": "call_0", "content": "1024"}])
    transcript.add_sampled(tokenizer.encode("The answer is 1024.") + [tokenizer.eos_id])
    transcript.extend([*transcript.messages, {"role": "user", "content": "Thanks."}])
    rendered = render_chat(tokenizer.chat_template, transcript.messages, tokenizer.special_tokens(),
                           tools=tools_of(tokenizer))
    assert transcript.ids == tokenizer.encode(rendered)
    sampled = [*tokenizer.encode(TOOL_TURN), *tokenizer.encode("The answer is 1024.")]
    assert sum(transcript.loss_mask) == len(sampled) + 2  # and their end tokens


def test_a_turn_cut_short_gets_the_templates_end_token_unsampled(tokenizer: Tokenizer) -> None:
    transcript = start(tokenizer)
    cut = tokenizer.encode("The answer")  # max_tokens reached: no end token sampled
    transcript.add_sampled(cut)
    added = transcript.extend([*transcript.messages, {"role": "user", "content": "Go on."}])
    assert added[0] == tokenizer.eos_id and transcript.loss_mask[-len(added)] == 0


def test_tool_calls_parse_into_openai_tool_calls_and_a_malformed_one_stays_content() -> None:
    message = parse_assistant(f"Let me compute. {TOOL_TURN}")
    assert message["content"] == "Let me compute."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("calculator", {"expression": "64*16"})]
    broken = '<tool_call>{"name": "calculator", "arguments": {"expression": "64*</tool_call>'
    assert parse_assistant(broken) == {"role": "assistant", "content": broken}
    no_arguments = '<tool_call>{"name": "calculator"}</tool_call>'
    assert parse_assistant(no_arguments) == {"role": "assistant", "content": no_arguments}


@pytest.mark.parametrize(("edit", "index", "reason"), [
    (lambda h: [{"role": "user", "content": "Oli has 65 boxes."}, *h[1:]], 0, "other content"),
    (lambda h: h[:1], 1, "is missing"),
    (lambda h: [h[1], h[0], *h[2:]], 0, "has role 'assistant' where the session has 'user'"),
    (lambda h: [h[0], {**h[1], "tool_calls": []}, *h[2:]], 1, "other tool_calls"),
    (lambda h: h, 2, "adds at least one message"),
    (lambda h: [*h, {"role": "assistant", "content": "The answer is 1024."}], 2, "did not sample"),
])
def test_a_history_that_does_not_extend_the_sessions_is_refused_naming_the_first_difference(
    edit: Any, index: int, reason: str
) -> None:
    tokenizer = load_tokenizer(REPO / "configs" / "models" / "bpe-agent")
    transcript = start(tokenizer)
    transcript.add_sampled(tokenizer.encode(TOOL_TURN) + [tokenizer.eos_id])
    before = (list(transcript.ids), list(transcript.messages))
    history = [dict(m) for m in transcript.messages]
    with pytest.raises(HistoryError, match=reason) as refused:
        transcript.extend(edit(history))
    assert refused.value.index == index and str(refused.value).startswith(f"messages[{index}] ")
    assert (transcript.ids, transcript.messages) == before  # nothing appended


def test_a_client_may_reserialize_tool_call_arguments() -> None:
    tokenizer = load_tokenizer(REPO / "configs" / "models" / "bpe-agent")
    transcript = start(tokenizer)
    transcript.add_sampled(tokenizer.encode(TOOL_TURN) + [tokenizer.eos_id])
    echoed = {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression":"64*16"}'}}]}
    sampled = list(transcript.ids)
    tool = {"role": "tool", "tool_call_id": "x", "content": "1024"}
    added = transcript.extend([transcript.messages[0], echoed, tool])  # its compact JSON is the same call
    assert added and transcript.ids == sampled + added and transcript.messages[-1] == tool
    assert "1024" in tokenizer.decode(added)


def test_a_template_that_rewrites_earlier_turns_cannot_be_bridged() -> None:
    """A template that renders an assistant turn's content only while it is the last message (as reasoning templates
    drop earlier thinking): appending after it would not be what the template writes."""
    tokenizer = load_tokenizer(REPO / "configs" / "models" / "bpe-math")
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' or loop.last %}"
                "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    transcript = Transcript.start(template, tokenizer, [{"role": "user", "content": "Hi"}])
    transcript.add_sampled(tokenizer.encode("Hello") + [tokenizer.eos_id])
    with pytest.raises(TemplateError, match="renders the session's history differently"):
        transcript.extend([*transcript.messages, {"role": "user", "content": "Again"}])
