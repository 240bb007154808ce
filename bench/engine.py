"""Decode throughput: the jetroll Engine against Hugging Face `generate()` and vLLM on the same tiny model and weights.

Every side runs fp32 on the CPU with the same torch thread count; tokens/s counts only the new tokens of a
batch (prefill time included), median of `repeats` timed runs after one warm-up run each. With vLLM installed the
bench also times a weight swap with requests in flight, on each engine, for the tiny model and a wider one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_state, save_pretrained
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import SPECIAL_TOKENS, build_char_tokenizer
from jetroll.shared.numerics import Numerics

SEED = 0


def _import_hf() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError("`jetroll bench engine` compares against Hugging Face transformers, a dev "
                           "dependency: pip install -e '.[dev]'") from exc
    return transformers


def tiny_args(vocab_size: int) -> ModelArgs:
    return ModelArgs(vocab_size=vocab_size, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=768, max_position_embeddings=4096)


def _wide_args(vocab_size: int) -> ModelArgs:
    return ModelArgs(vocab_size=vocab_size, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8,
                     intermediate_size=2816, max_position_embeddings=4096)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _hf_runner(hf_model: Any, prompts: torch.Tensor, new_tokens: int) -> Callable[[], None]:
    attention_mask = torch.ones_like(prompts)

    def run() -> None:
        with torch.inference_mode():
            out = hf_model.generate(input_ids=prompts, attention_mask=attention_mask, do_sample=True, top_k=0,
                                    top_p=1.0, temperature=1.0, min_new_tokens=new_tokens,
                                    max_new_tokens=new_tokens)
        assert out.shape[1] == prompts.shape[1] + new_tokens

    return run


def _engine_runner(
    model: CausalLM, prompts: torch.Tensor, new_tokens: int, eos_id: int, compile: bool
) -> tuple[Callable[[], None], float]:
    """The timed run, and the engine's compile time (paid once at construction, outside the runs)."""
    from jetroll.shared.engine.engine import Engine

    bsz, prompt_len = prompts.shape
    engine = Engine(model, eos_id=eos_id, max_batch=bsz, max_len=prompt_len + new_tokens, seed=SEED, compile=compile)
    return _generate_runner(engine, prompts, new_tokens), engine.compile_s


def _generate_runner(engine: Any, prompts: torch.Tensor, new_tokens: int) -> Callable[[], None]:
    """One timed run: every prompt generates exactly `new_tokens` on `engine` (jetroll's or vLLM's)."""
    from jetroll.shared.engine.request import Request

    rows = prompts.tolist()

    def run() -> None:
        requests = [Request(f"r{i}", rows[i], new_tokens, ignore_eos=True) for i in range(len(rows))]
        engine.generate(requests)
        assert all(len(r.output_ids) == new_tokens for r in requests)

    return run


def _swap_cost(make_engine: Callable[[], Any], states: list[dict[str, torch.Tensor]], prompt_len: int,
               repeats: int) -> dict[str, float]:
    """Seconds from pause to resume of a swap with 16 requests in flight (64 tokens each so far, 32-token prompts):
    `swap_s` is `swap_weights` (jetroll: load + KV recompute; vLLM: abort, reload, cache reset, resubmit) and
    `first_step_s` the step after it (vLLM re-prefills there); medians over `repeats` swaps."""
    from jetroll.shared.engine.request import Request

    engine = make_engine()
    generator = torch.Generator().manual_seed(SEED)
    prompts = torch.randint(len(SPECIAL_TOKENS), 40, (16, prompt_len), generator=generator).tolist()
    swaps, steps = [], []
    for i in range(repeats):
        requests = [Request(f"swap{i}-{j}", prompts[j], 512, ignore_eos=True) for j in range(16)]
        engine.add(requests)
        while min(len(r.output_ids) for r in requests) < 64:
            engine.step()
        swaps.append(_timed(lambda i=i: engine.swap_weights(states[(i + 1) % 2], i + 1)))
        steps.append(_timed(engine.step))
        for request in requests:  # done with them: end them without decoding the rest
            request.max_new_tokens = len(request.output_ids) + 1
        while engine.has_work:
            engine.step()
    swap_s, first_step_s = statistics.median(swaps), statistics.median(steps)
    return {"swap_s": swap_s, "first_step_s": first_step_s, "pause_to_resume_s": swap_s + first_step_s}


def run_engine_bench(
    batch_sizes: tuple[int, ...] = (1, 16, 64),
    prompt_len: int = 32,
    new_tokens: int = 256,
    threads: int = 2,
    repeats: int = 3,
    include_fp8: bool = True,
    compile: bool = True,
    include_vllm: bool | None = None,
    swap_shapes: tuple[str, ...] = ("tiny", "wide"),
) -> dict[str, Any]:
    """Tokens/s of jetroll (fp32, optionally fp8_unified) vs HF `Qwen2ForCausalLM.generate()` and vLLM (fp32, when
    `include_vllm`, or None and vLLM is installed), per batch size; with vLLM, the swap cost on both engines."""
    transformers = _import_hf()
    if include_vllm is None:
        include_vllm = importlib.util.find_spec("vllm") is not None
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, previous_threads)
        tokenizer = build_char_tokenizer()
        torch.manual_seed(SEED)
        fp32_model = CausalLM(tiny_args(tokenizer.vocab_size)).eval()
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        save_pretrained(fp32_model, tokenizer, directory / "tiny")
        hf_model = transformers.Qwen2ForCausalLM.from_pretrained(directory / "tiny", dtype=torch.float32).eval()
        vllm_engine = None
        if include_vllm:
            from jetroll.shared.engine.vllm import VllmEngine

            # one engine for every batch size: vLLM schedules what it is given, up to max_num_seqs
            vllm_engine = VllmEngine(directory / "tiny", fp32_model.args, tokenizer.vocab_size, "fp32",
                                     max_batch=max(batch_sizes), max_len=prompt_len + new_tokens, seed=SEED,
                                     compile=compile, threads=threads)
        fp8_model = None
        if include_fp8:
            fp8_model = CausalLM(fp32_model.args, Numerics(mode="fp8_unified")).eval()
            load_state(fp8_model, fp32_model.state_dict())
        generator = torch.Generator().manual_seed(SEED)
        rows = []
        for bsz in batch_sizes:
            prompts = torch.randint(len(SPECIAL_TOKENS), tokenizer.vocab_size, (bsz, prompt_len), generator=generator)
            runners = {"hf": _hf_runner(hf_model, prompts, new_tokens)}
            compile_s = {}
            runners["jetroll_fp32"], compile_s["jetroll_fp32"] = _engine_runner(
                fp32_model, prompts, new_tokens, tokenizer.eos_id, compile)
            if fp8_model is not None:
                runners["jetroll_fp8"], compile_s["jetroll_fp8"] = _engine_runner(
                    fp8_model, prompts, new_tokens, tokenizer.eos_id, compile)
            if vllm_engine is not None:
                runners["vllm"], compile_s["vllm"] = _generate_runner(vllm_engine, prompts, new_tokens), 0.0
            rows.append(_batch_row(bsz, bsz * new_tokens, runners, compile_s, repeats))
        swap = {} if vllm_engine is None else _swap_costs(swap_shapes, fp32_model.args, tokenizer, directory,
                                                          prompt_len, repeats, threads)
    return {
        "config": _bench_config(prompt_len, new_tokens, threads, repeats, compile, vllm_engine, transformers),
        "rows": rows,
        "swap": swap,
        "summary": _summary(rows, include_fp8),
    }


def _bench_config(prompt_len: int, new_tokens: int, threads: int, repeats: int, compile: bool, vllm_engine: Any,
                  transformers: Any) -> dict[str, Any]:
    """What the bench ran, for its JSON."""
    vllm_version = importlib.import_module("vllm").__version__ if vllm_engine is not None else None
    return {
        "model": "qwen2 hidden=256 layers=4 heads=4 kv_heads=2 intermediate=768, fp32, random init",
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "threads": threads,
        "repeats": repeats,
        "statistic": "median of repeats after one warm-up run; tokens/s counts new tokens only, prefill included",
        "hf": "Qwen2ForCausalLM.generate(do_sample=True, top_k=0, top_p=1, temperature=1, "
              "min_new_tokens=max_new_tokens) under inference_mode; sdpa attention, DynamicCache",
        "jetroll": "Engine.generate, temperature=1, top_p=1, ignore_eos; "
                   + ("decode under torch.compile, attention through the CPU decode-attention kernel "
                      "(compile_s: once per engine, not in runs_s)" if compile
                      else "eager decode (warm-up = first run)"),
        "vllm": (f"vllm {vllm_version} LLMEngine in this process (VllmEngine), fp32, {threads} torch "
                 f"threads, cores not bound, {'torch.compile' if compile else 'eager'}; one engine for every "
                 f"batch size (start-up {vllm_engine.compile_s:.1f} s, outside the runs)") if vllm_engine
                else "not installed: no vLLM column",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
    }


def _batch_row(bsz: int, num_tokens: int, runners: dict[str, Callable[[], None]], compile_s: dict[str, float],
               repeats: int) -> dict[str, Any]:
    """Time every runner of one batch size: a warm-up each, then `repeats` rounds, interleaved."""
    warmup_s = {name: _timed(run) for name, run in runners.items()}
    runs_s: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):  # interleaved, so machine noise hits every side alike
        for name, run in runners.items():
            runs_s[name].append(_timed(run))
    tps = {name: num_tokens / statistics.median(times) for name, times in runs_s.items()}
    return {
        "batch_size": bsz,
        "hf_tokens_per_s": tps["hf"],
        "jetroll_fp32_tokens_per_s": tps["jetroll_fp32"],
        "jetroll_fp8_tokens_per_s": tps.get("jetroll_fp8"),
        "speedup_fp32_vs_hf": tps["jetroll_fp32"] / tps["hf"],
        "fp8_over_fp32": tps["jetroll_fp8"] / tps["jetroll_fp32"] if "jetroll_fp8" in tps else None,
        "vllm_tokens_per_s": tps.get("vllm"),
        "jetroll_over_vllm": tps["jetroll_fp32"] / tps["vllm"] if "vllm" in tps else None,
        "compile_s": compile_s,
        "warmup_s": warmup_s,
        "runs_s": runs_s,
    }


def _swap_costs(swap_shapes: tuple[str, ...], tiny_args: ModelArgs, tokenizer: Any, directory: Path, prompt_len: int,
                repeats: int, threads: int) -> dict[str, dict[str, Any]]:
    """The swap cost of each shape on the jetroll engine and on vLLM."""
    from jetroll.shared.engine.engine import Engine
    from jetroll.shared.engine.vllm import VllmEngine

    shapes = {"tiny": tiny_args, "wide": _wide_args(tokenizer.vocab_size)}
    swap = {}
    for shape, args in ((shape, shapes[shape]) for shape in swap_shapes):
        models = [CausalLM(args).eval() for _ in range(2)]
        for i, model in enumerate(models):
            save_pretrained(model, tokenizer, directory / f"{shape}{i}")
        states = [load_file(str(directory / f"{shape}{i}" / "model.safetensors")) for i in range(2)]
        max_len = prompt_len + 512
        swap[shape] = {
            "params": sum(p.numel() for p in models[0].parameters()),
            "jetroll": _swap_cost(lambda m=models[0], n=max_len: Engine(m, tokenizer.eos_id, 16, n), states,
                                  prompt_len, repeats),
            "vllm": _swap_cost(lambda d=directory / f"{shape}0", a=args, n=max_len: VllmEngine(
                d, a, tokenizer.vocab_size, "fp32", 16, n, threads=threads), states, prompt_len, repeats),
        }
    return swap


def _summary(rows: list[dict[str, Any]], include_fp8: bool) -> dict[str, Any]:
    by_batch = {row["batch_size"]: row for row in rows}
    if include_fp8 and 64 in by_batch:
        fp8_over_fp32 = by_batch[64]["fp8_over_fp32"]
    elif include_fp8:
        fp8_over_fp32 = statistics.mean(row["fp8_over_fp32"] for row in rows)
    else:
        fp8_over_fp32 = None
    return {
        "speedup_b1": by_batch[1]["speedup_fp32_vs_hf"] if 1 in by_batch else None,
        "speedup_b64": by_batch[64]["speedup_fp32_vs_hf"] if 64 in by_batch else None,
        "fp8_over_fp32": fp8_over_fp32,
        "fp8_over_fp32_basis": "batch 64" if 64 in by_batch else ("mean over batch sizes" if include_fp8 else None),
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    table = Table(title=f"engine decode, {config['prompt_len']}-token prompts, {config['new_tokens']} new tokens, "
                        f"{config['threads']} threads (tokens/s, median of {config['repeats']})")
    for column in ("batch", "HF generate", "jetroll fp32", "speedup", "jetroll fp8", "fp8/fp32", "vLLM",
                   "jetroll/vLLM", "warm-up s", "compile s"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        fp8, vllm = row["jetroll_fp8_tokens_per_s"], row["vllm_tokens_per_s"]
        warmup = " / ".join(f"{name.removeprefix('jetroll_')} {s:.2f}" for name, s in row["warmup_s"].items())
        table.add_row(
            str(row["batch_size"]),
            f"{row['hf_tokens_per_s']:.0f}",
            f"{row['jetroll_fp32_tokens_per_s']:.0f}",
            f"{row['speedup_fp32_vs_hf']:.2f}x",
            f"{fp8:.0f}" if fp8 is not None else "-",
            f"{row['fp8_over_fp32']:.2f}x" if row["fp8_over_fp32"] is not None else "-",
            f"{vllm:.0f}" if vllm is not None else "-",
            f"{row['jetroll_over_vllm']:.2f}x" if vllm is not None else "-",
            warmup,
            " / ".join(f"{name.removeprefix('jetroll_')} {s:.1f}" for name, s in row["compile_s"].items()),
        )
    console = Console()
    console.print(table)
    if result["swap"]:
        swaps = Table(title="a weight swap with 16 requests in flight (64 tokens in): pause to resume, s (median)")
        for column in ("model", "params", "jetroll swap + next step", "vLLM swap + next step"):
            swaps.add_column(column, justify="right")
        for shape, cost in result["swap"].items():
            swaps.add_row(shape, f"{cost['params'] / 1e6:.1f}M", *(
                f"{cost[e]['swap_s']:.3f} + {cost[e]['first_step_s']:.3f}" for e in ("jetroll", "vllm")))
        console.print(swaps)
    console.print(config["vllm"])
    summary = result["summary"]
    console.print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


def main(argv_json: bool, **kwargs: Any) -> dict[str, Any]:
    """CLI hook for `jetroll bench engine [--json]`: run the bench, print JSON or a table."""
    import json

    result = run_engine_bench(**kwargs)
    if argv_json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return result
