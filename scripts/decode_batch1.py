"""Where a batch-1 token's time goes in the jetroll engine: `python scripts/decode_batch1.py`, on the engine bench's
model (`jetroll bench engine`: 3.2M parameters, fp32, a 32-token prompt, 256 new tokens), at 2 threads and at 1. It
times the compiled decode call apart from the rest of the step (sampling and the Python around it); medians of 3
runs after a warm-up."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from jetroll.bench.engine import SEED, tiny_args
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import SPECIAL_TOKENS, build_char_tokenizer

NEW_TOKENS = 256


def main() -> None:
    tokenizer = build_char_tokenizer()
    torch.manual_seed(SEED)
    model = CausalLM(tiny_args(tokenizer.vocab_size)).eval()
    weight_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    generator = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(len(SPECIAL_TOKENS), tokenizer.vocab_size, (32,), generator=generator).tolist()
    for threads in (2, 1):
        torch.set_num_threads(threads)
        engine = Engine(model, tokenizer.eos_id, max_batch=1, max_len=32 + NEW_TOKENS, seed=SEED, compile=True)
        compiled, decode_s = engine.decode_fn, []

        def timed_decode(*args: Any, compiled: Any = compiled, decode_s: list[float] = decode_s) -> Any:
            start = time.perf_counter()
            out = compiled(*args)
            decode_s.append(time.perf_counter() - start)
            return out

        engine.decode_fn = timed_decode
        runs, decodes = [], []
        for _ in range(4):  # the first is a warm-up
            decode_s.clear()
            start = time.perf_counter()
            engine.generate([Request("r", prompt, NEW_TOKENS, ignore_eos=True)])
            runs.append((time.perf_counter() - start) / NEW_TOKENS)
            decodes.append(statistics.median(decode_s))
        token_s, decode = statistics.median(runs[1:]), statistics.median(decodes[1:])
        print(f"threads {threads}: {1 / token_s:.0f} tokens/s, {token_s * 1e6:.0f} us a token: compiled decode "
              f"{decode * 1e6:.0f} us ({weight_mb / 1e3 / decode:.1f} GB/s over {weight_mb:.1f} MB of weights), "
              f"the rest {(token_s - decode) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
