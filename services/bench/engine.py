"""Decode throughput: the jetroll Engine against Hugging Face `generate()` on the same tiny model and weights.

Both sides run fp32 on the CPU with the same thread count; tokens/s counts only the new tokens of a
batch (prefill time included), median of `repeats` timed runs after one warm-up run each.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_state, save_pretrained
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.numerics import Precision
from jetroll.shared.model.tokenizer import SPECIAL_TOKENS, build_char_tokenizer

SEED = 0


def _import_hf() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError("`jetroll bench engine` compares against Hugging Face transformers, a dev "
                           "dependency: pip install -e '.[dev]'") from exc
    return transformers


def _tiny_args(vocab_size: int) -> ModelArgs:
    return ModelArgs(vocab_size=vocab_size, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=768, max_position_embeddings=4096)


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
    from jetroll.services.rollout.engine import Engine, Request

    bsz, prompt_len = prompts.shape
    engine = Engine(model, eos_id=eos_id, max_batch=bsz, max_len=prompt_len + new_tokens, seed=SEED, compile=compile)
    rows = prompts.tolist()

    def run() -> None:
        requests = [Request(f"r{i}", rows[i], new_tokens, ignore_eos=True) for i in range(bsz)]
        engine.generate(requests)
        assert all(len(r.output_ids) == new_tokens for r in requests)

    return run, engine.compile_s


def run_engine_bench(
    batch_sizes: tuple[int, ...] = (1, 16, 64),
    prompt_len: int = 32,
    new_tokens: int = 256,
    threads: int = 2,
    repeats: int = 3,
    include_fp8: bool = True,
    compile: bool = True,
) -> dict[str, Any]:
    """Tokens/s of jetroll (fp32, optionally fp8_unified) vs HF `Qwen2ForCausalLM.generate()`, per batch size."""
    transformers = _import_hf()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokenizer = build_char_tokenizer()
        torch.manual_seed(SEED)
        fp32_model = CausalLM(_tiny_args(tokenizer.vocab_size)).eval()
        with tempfile.TemporaryDirectory() as directory:
            save_pretrained(fp32_model, tokenizer, directory)
            hf_model = transformers.Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        fp8_model = None
        if include_fp8:
            fp8_model = CausalLM(fp32_model.args, Precision(mode="fp8_unified")).eval()
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
            warmup_s = {name: _timed(run) for name, run in runners.items()}
            runs_s: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(repeats):  # interleaved, so machine noise hits every side alike
                for name, run in runners.items():
                    runs_s[name].append(_timed(run))
            num_tokens = bsz * new_tokens
            tps = {name: num_tokens / statistics.median(times) for name, times in runs_s.items()}
            row: dict[str, Any] = {
                "batch_size": bsz,
                "hf_tokens_per_s": tps["hf"],
                "jetroll_fp32_tokens_per_s": tps["jetroll_fp32"],
                "jetroll_fp8_tokens_per_s": tps.get("jetroll_fp8"),
                "speedup_fp32_vs_hf": tps["jetroll_fp32"] / tps["hf"],
                "fp8_over_fp32": tps["jetroll_fp8"] / tps["jetroll_fp32"] if "jetroll_fp8" in tps else None,
                "compile_s": compile_s,
                "warmup_s": warmup_s,
                "runs_s": runs_s,
            }
            rows.append(row)
    finally:
        torch.set_num_threads(previous_threads)
    by_batch = {row["batch_size"]: row for row in rows}
    fp8_basis = 64 if 64 in by_batch else None
    if include_fp8 and fp8_basis is not None:
        fp8_over_fp32 = by_batch[64]["fp8_over_fp32"]
    elif include_fp8:
        fp8_over_fp32 = statistics.mean(row["fp8_over_fp32"] for row in rows)
    else:
        fp8_over_fp32 = None
    return {
        "config": {
            "model": "qwen2 hidden=256 layers=4 heads=4 kv_heads=2 intermediate=768, fp32, random init",
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "threads": threads,
            "repeats": repeats,
            "statistic": "median of repeats after one warm-up run; tokens/s counts new tokens only, prefill included",
            "hf": "Qwen2ForCausalLM.generate(do_sample=True, top_k=0, top_p=1, temperature=1, "
                  "min_new_tokens=max_new_tokens) under inference_mode; sdpa attention, DynamicCache",
            "jetroll": "Engine.generate, temperature=1, top_p=1, ignore_eos; "
                       + ("decode under torch.compile (compile_s: once per engine, not in runs_s)" if compile
                          else "eager decode (warm-up = first run)"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu": platform.processor() or platform.machine(),
        },
        "rows": rows,
        "summary": {
            "speedup_b1": by_batch[1]["speedup_fp32_vs_hf"] if 1 in by_batch else None,
            "speedup_b64": by_batch[64]["speedup_fp32_vs_hf"] if 64 in by_batch else None,
            "fp8_over_fp32": fp8_over_fp32,
            "fp8_over_fp32_basis": "batch 64" if fp8_basis else ("mean over batch sizes" if include_fp8 else None),
        },
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    table = Table(title=f"engine decode, {config['prompt_len']}-token prompts, {config['new_tokens']} new tokens, "
                        f"{config['threads']} threads (tokens/s, median of {config['repeats']})")
    for column in ("batch", "HF generate", "jetroll fp32", "speedup", "jetroll fp8", "fp8/fp32", "warm-up s",
                   "compile s"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        fp8 = row["jetroll_fp8_tokens_per_s"]
        warmup = " / ".join(f"{name.removeprefix('jetroll_')} {s:.2f}" for name, s in row["warmup_s"].items())
        table.add_row(
            str(row["batch_size"]),
            f"{row['hf_tokens_per_s']:.0f}",
            f"{row['jetroll_fp32_tokens_per_s']:.0f}",
            f"{row['speedup_fp32_vs_hf']:.2f}x",
            f"{fp8:.0f}" if fp8 is not None else "-",
            f"{row['fp8_over_fp32']:.2f}x" if row["fp8_over_fp32"] is not None else "-",
            warmup,
            " / ".join(f"{name.removeprefix('jetroll_')} {s:.1f}" for name, s in row["compile_s"].items()),
        )
    console = Console()
    console.print(table)
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
