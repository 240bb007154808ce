"""Runs the vllm engine's scenarios in a process of its own and prints what each request generated, as JSON.

vLLM's start-up scans every imported module's attributes, and a werkzeug proxy (moto's server imports flask into
the test process) raises there, so the tests drive vLLM from here: `python vllm_driver.py MODEL_A MODEL_B PROMPT`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from jetroll.services.rollout.engine import Request
from jetroll.services.rollout.vllm_engine import VllmEngine
from jetroll.shared.config.base import JobFailedError
from jetroll.shared.model.checkpoint import read_args
from jetroll.shared.model.tokenizer import load_tokenizer


def main(first: Path, second: Path, prompt_chars: str) -> dict[str, list[dict[str, object]]]:
    args, _ = read_args(first)
    engine = VllmEngine(first, args, load_tokenizer(first).vocab_size, "fp32", max_batch=8, max_len=256, seed=3)
    weights = {0: load_file(str(first / "model.safetensors")), 1: load_file(str(second / "model.safetensors"))}
    prompt = load_tokenizer(first).encode(prompt_chars)
    out: dict[str, list[Request]] = {}

    out["mu"] = engine.generate([Request(f"t{i}", prompt, 24, temperature=0.7, ignore_eos=True) for i in range(6)])

    swapped = [Request(f"s{i}", prompt, 30, temperature=1.0, ignore_eos=True) for i in range(4)]
    engine.add(swapped)
    while min(len(r.output_ids) for r in swapped) < 8:
        engine.step()
    engine.swap_weights(weights[1], 1)
    while engine.has_work:
        engine.step()
    out["swap"] = swapped

    def greedy(request_id: str) -> Request:
        return engine.generate([Request(request_id, prompt, 6, temperature=0.0, ignore_eos=True)])[0]

    engine.swap_weights(weights[0], 2)
    out["prefix"] = [greedy("warm-a")]  # the prompt's blocks now hold KV of the first model
    engine.swap_weights(weights[1], 3)
    out["prefix"].append(greedy("after-swap"))
    # the control: a swap that keeps the cache, so the second model's prompt KV meets the first model's weights
    engine.llm.reset_prefix_cache = lambda: True
    engine.swap_weights(weights[0], 4)
    out["prefix"].append(greedy("stale"))
    return {name: [{"request_id": r.request_id, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                    "logprobs": r.logprobs, "versions": r.versions, "temperature": r.temperature,
                    "finish_reason": r.finish_reason} for r in requests] for name, requests in out.items()}


def start(directory: Path, mode: str) -> dict[str, object]:
    """Start the engine on a published version in `mode` and sample; or say, in its one line, why it cannot."""
    args, _ = read_args(directory)
    try:
        engine = VllmEngine(directory, args, load_tokenizer(directory).vocab_size, mode, 4, 64)
    except JobFailedError as exc:
        return {"refused": str(exc)}
    request = engine.generate([Request("start", [5, 6, 7, 8], 8, ignore_eos=True)])[0]
    return {"output_ids": request.output_ids, "logprobs": request.logprobs}


if __name__ == "__main__":
    if sys.argv[1] == "start":
        print(json.dumps(start(Path(sys.argv[2]), sys.argv[3])))
    else:
        print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])))
