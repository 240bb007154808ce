"""Write data/math_word.jsonl (GSM8K-style word problems: `question`, a worked `solution`, a numeric `answer`) and
configs/models/bpe-math (a byte-level BPE tokenizer trained on them, with a Qwen-style chat template and
`<|im_end|>` as its stop token), since nothing can be downloaded from a data or model hub. Deterministic: the files
are a pure function of this script. Run from the repository root."""

from __future__ import annotations

import json
import random
from pathlib import Path

from jetroll.shared.model.tokenizer import write_bpe_tokenizer

DATA = Path("data/math_word.jsonl")
TOKENIZER = Path("configs/models/bpe-math")
NUM_ROWS = 4000
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen's layout without its default system message: the prompt stays short on a 2-core CPU
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned", "Oli", "Pam"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cookies", "stickers"]


def problem(rng: random.Random) -> dict[str, str]:
    """One or two steps of + and - on numbers below 50, as a short story, solved in words: a completion of about
    30-50 tokens, long enough that decoding, not the step's fixed costs, is what a job times."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(2, 49)
    kind = rng.randrange(4)
    if kind == 0:
        b = rng.randint(1, 49)
        return _row(f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
                    [f"{name} starts with {a} {item}", f"{name} gets {b} more, so {name} has {a}+{b}={a + b} {item}"],
                    a + b)
    if kind == 1:
        b = rng.randint(1, a)
        return _row(f"{name} has {a} {item} and gives away {b}. How many {item} are left?",
                    [f"{name} starts with {a} {item}", f"{name} gives away {b}, so {a}-{b}={a - b} {item} are left"],
                    a - b)
    b, c = rng.randint(1, 49), rng.randint(1, 49)
    if kind == 2:
        return _row(f"{name} has {a} {item}, buys {b} more, then buys {c} more. How many {item} now?",
                    [f"{name} starts with {a} {item}", f"After buying {b} more, {name} has {a}+{b}={a + b}",
                     f"After buying {c} more, {name} has {a + b}+{c}={a + b + c}"], a + b + c)
    c = rng.randint(1, a + b)
    return _row(f"{name} has {a} {item}, finds {b} more, then loses {c}. How many {item} now?",
                [f"{name} starts with {a} {item}", f"After finding {b} more, {name} has {a}+{b}={a + b}",
                 f"After losing {c}, {name} has {a + b}-{c}={a + b - c}"], a + b - c)


def _row(question: str, steps: list[str], answer: int) -> dict[str, str]:
    # the math reward reads the final answer: the last sentence states it alone
    return {"question": question, "solution": ". ".join([*steps, f"The answer is {answer}"]) + ".",
            "answer": str(answer)}


def main() -> None:
    rng = random.Random(0)
    rows, seen = [], set()
    while len(rows) < NUM_ROWS:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text("".join(json.dumps(row) + "\n" for row in rows))
    corpus = [text for row in rows for text in (row["question"], row["solution"])]
    vocab_size = write_bpe_tokenizer(TOKENIZER, corpus, 512, SPECIAL, {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE})
    print(f"{DATA}: {len(rows)} rows; {TOKENIZER}: {vocab_size} tokens")


if __name__ == "__main__":
    main()
