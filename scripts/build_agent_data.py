"""Write data/agent_calc.jsonl (word problems an agent solves with a `calculator` tool: `question`, `answer`, and a
worked tool-use transcript in OpenAI's message format) and configs/models/bpe-agent (a byte-level BPE tokenizer
trained on the transcripts as its chat template renders them, tools included, with `<|im_end|>` as its stop token),
since nothing can be downloaded from a data or model hub. The template is Qwen2.5's layout for tools: the tool specs
in the system turn, calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the assistant's turn,
results in `tool` turns. Deterministic: the files are a pure function of this script. Run from the repository root."""

from __future__ import annotations

import json
import random
from pathlib import Path

from jetroll.shared.model.chat import render_chat
from jetroll.shared.model.tokenizer import write_bpe_tokenizer

DATA = Path("data/agent_calc.jsonl")
TOKENIZER = Path("configs/models/bpe-agent")
NUM_ROWS = 4000
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call these tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>tool\n{{ message['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned", "Oli", "Pam"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cookies", "stickers"]


def problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, the expression that solves it, answer): products of two-digit numbers, which the tiny model cannot
    do in its head, so the tool is worth calling."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    if rng.randrange(2):
        return f"{name} has {a} boxes of {b} {item}. How many {item} is that?", f"{a}*{b}", a * b
    c = rng.randint(1, 99)
    return (f"{name} has {a} boxes of {b} {item} and {c} loose {item}. How many {item} in all?", f"{a}*{b}+{c}",
            a * b + c)


def transcript(question: str, expression: str, answer: int) -> list[dict]:
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(answer)},
            {"role": "assistant", "content": f"The answer is {answer}."}]


def main() -> None:
    rng = random.Random(0)
    rows, seen = [], set()
    while len(rows) < NUM_ROWS:
        question, expression, answer = problem(rng)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": str(answer),
                         "messages": transcript(question, expression, answer)})
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text("".join(json.dumps(row) + "\n" for row in rows))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    corpus = [render_chat(TEMPLATE, row["messages"], special, tools=[CALCULATOR], add_generation_prompt=False)
              for row in rows]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "chat_template": TEMPLATE}
    vocab_size = write_bpe_tokenizer(TOKENIZER, corpus, 768, SPECIAL, config)
    print(f"{DATA}: {len(rows)} rows; {TOKENIZER}: {vocab_size} tokens")


if __name__ == "__main__":
    main()
