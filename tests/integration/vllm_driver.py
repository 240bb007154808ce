"""Runs the vllm engine's scenarios in a process of its own and prints what each request generated, as JSON.

vLLM's start-up scans every imported module's attributes, and a werkzeug proxy (moto's server imports flask into
the test process) raises there, so the tests drive vLLM from here: `python vllm_driver.py MODEL_A MODEL_B PROMPT`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from jetroll.shared.engine.interface import probe
from jetroll.shared.engine.request import Request
from jetroll.shared.engine.vllm import VllmEngine
from jetroll.shared.errors import JobFailedError
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


def force(how: str) -> str | None:
    """"amx-fp8-kernel": select vLLM's CPU block-FP8 kernel, which vLLM offers only with AMX, where its op exists
    without AMX (AVX-512 builds; None where it does not). "failing-forward": every attention forward raises as vLLM's
    FP8 GEMM did on AMX, with C++ frames below its first line."""
    if how == "amx-fp8-kernel":
        from vllm.model_executor.kernels.linear.scaled_mm import cpu

        if not cpu.ops._supports_cpu_fp8_w8a16:
            return None
        cpu.CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    elif how == "failing-forward":
        from vllm.model_executor.models import qwen2

        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError("expected scalar type Float but found BFloat16\nException raised from data_ptr at "
                               "TensorImpl.h:1\nframe #0: c10::Error::Error")

        qwen2.Qwen2Attention.forward = fail
    return how


def start(directory: Path, mode: str, how: str = "") -> dict[str, object]:
    """Start the engine on a published version in `mode` (forced `how`), probe it as the worker does, and sample;
    or say, in its one line, why it cannot."""
    if force(how) is None:
        return {"no_kernel": "this vLLM build has no fp8_scaled_mm_cpu op"}
    args, _ = read_args(directory)
    try:
        engine = VllmEngine(directory, args, load_tokenizer(directory).vocab_size, mode, 4, 64)
        probe(engine, "vllm")
    except JobFailedError as exc:
        return {"refused": str(exc)}
    request = engine.generate([Request("start", [5, 6, 7, 8], 8, ignore_eos=True)])[0]
    return {"output_ids": request.output_ids, "logprobs": request.logprobs}


def fp8_swap(first: Path, second: Path, how: str) -> dict[str, object]:
    """fp8_unified on vLLM: 4 samples of 16 tokens at T = 0.7 from the first version, a swap, 4 more from the second."""
    if force(how) is None:
        return {"no_kernel": "this vLLM build has no fp8_scaled_mm_cpu op"}
    engine = VllmEngine(first, read_args(first)[0], load_tokenizer(first).vocab_size, "fp8_unified", 4, 64, seed=5)
    try:
        probe(engine, "vllm")
    except JobFailedError as exc:
        return {"refused": str(exc)}
    prompt = load_tokenizer(first).encode("123+456=579\n98")
    out = {}
    for version, directory in enumerate((first, second)):
        if version:
            engine.swap_weights(load_file(str(directory / "model.safetensors")), version)
        requests = [Request(f"v{version}-{i}", prompt, 16, temperature=0.7, ignore_eos=True) for i in range(4)]
        out[str(version)] = [{"prompt_ids": r.prompt_ids, "output_ids": r.output_ids, "logprobs": r.logprobs,
                              "versions": r.versions, "temperature": r.temperature} for r in engine.generate(requests)]
    return out


if __name__ == "__main__":
    if sys.argv[1] == "start":
        print(json.dumps(start(Path(sys.argv[2]), *sys.argv[3:])))
    elif sys.argv[1] == "fp8-swap":
        print(json.dumps(fp8_swap(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])))
    else:
        print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])))
