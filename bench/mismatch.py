"""Training-inference mismatch by precision mode and rollout length: Jet-RL's drift experiment on a tiny model.

The same weights, prompts and sampled tokens in every mode: one FP8 rollout engine samples `num_samples` completions
of the longest length once. Then each mode scores those tokens with both of its sides, on the exact backend:
  rollout side: the engine's path from the published checkpoint bytes: prefill the prompt into a KV cache, decode
                one token at a time for the whole batch, log_softmax of each step's logits (what rollout records as mu);
  trainer side: the trainer's no-grad full-sequence pass (`proximal_pass`) on its fp32 master weights.
delta = logp_trainer - logp_rollout; length L reports the first L completion tokens of every sample. A side whose
numerics another mode shares (fp8_unified and fp8_rollout_only roll out alike) is computed once.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.model import exact
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_pretrained, load_state, save_pretrained
from jetroll.shared.model.model import CausalLM, KVCache
from jetroll.shared.model.tokenizer import SPECIAL_TOKENS, build_char_tokenizer
from jetroll.shared.numerics import Numerics
from jetroll.shared.rl.mismatch import mismatch_stats
from jetroll.shared.rl.passes import proximal_pass

MODES = ("bf16", "fp8_unified", "fp8_rollout_only")
METRICS = ("abs_mean", "abs_max", "k3", "exp_abs_mean", "seq_delta_abs_mean", "tis_clip_frac")
TIS_CAP = PrecisionConfig().correction_cap  # the loss's default C: tis_clip_frac counts what it would cap


def _tiny_model(vocab_size: int, seed: int) -> CausalLM:
    args = ModelArgs(vocab_size=vocab_size, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=768, max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = CausalLM(args).eval()
    with torch.no_grad():  # tied N(0, 1) embeddings give near one-hot softmaxes; soften them so sampling samples
        model.model.embed_tokens.weight.mul_(0.2)
    return model


def decode_logprobs(model: CausalLM, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """The rollout engine's log-probs [N, C] of given completions: prefill each prompt, then batched decode."""
    num, prompt_len = prompts.shape
    cache = KVCache(model.args, num, prompt_len + completions.shape[1])
    out = torch.empty(completions.shape)
    with torch.inference_mode():
        for slot in range(num):
            logits = model(prompts[slot : slot + 1], torch.arange(prompt_len), cache, slot=slot)
            out[slot, 0] = exact.log_softmax(logits[:, -1])[0, completions[slot, 0]]
        for t in range(1, completions.shape[1]):
            position = prompt_len + t - 1
            logits = model.decode(completions[:, t - 1 : t], torch.full((num,), position), cache, position + 1)
            out[:, t] = exact.log_softmax(logits[:, 0]).gather(1, completions[:, t : t + 1])[:, 0]
    return out


def trainer_logprobs(model: CausalLM, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    ids = torch.cat([prompts, completions], dim=1)
    logprobs, _ = proximal_pass(model, ids[:, :-1], ids[:, 1:], torch.ones(len(ids)))
    return logprobs[:, prompts.shape[1] - 1 :]


def _score_both_sides(mode: str, master: CausalLM, published: Path, prompts: torch.Tensor,
                      completions: torch.Tensor, scored: dict[tuple[str, str], torch.Tensor],
                      timings_s: dict[str, float]) -> dict[str, torch.Tensor]:
    """The completions' log-probs as rollout (from the published bytes) and the trainer (from the fp32 masters)
    compute them in `mode`; each side's format is scored once (`scored`), whichever mode asks first."""
    config = Numerics(mode=mode, backend="exact")
    sides = {}
    for side, side_config in (("rollout", config), ("trainer", config.trainer_side())):
        key = (side, side_config.linear_format("q_proj"))
        if key not in scored:
            started = time.perf_counter()
            if side == "rollout":  # from the bytes rollout would load
                model, _ = load_pretrained(published, side_config)
                scored[key] = decode_logprobs(model, prompts, completions)
            else:  # the trainer holds fp32 masters and rounds them itself
                model = CausalLM(master.args, side_config).eval()
                load_state(model, master.state_dict())
                scored[key] = trainer_logprobs(model, prompts, completions)
            timings_s[f"{side}_{key[1]}_exact"] = time.perf_counter() - started
        sides[side] = scored[key]
    return sides


def run_mismatch_bench(
    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048), num_samples: int = 8, prompt_len: int = 16,
    threads: int = 1, seed: int = 0, model_path: str | None = None,
) -> dict[str, Any]:
    """Per mode and length: mean/max |delta|, k3, exp(mean |delta|), mean |sequence sum delta|, TIS clip fraction.

    `model_path` (an HF-format dir) replaces the random tiny model.
    """
    lengths = tuple(sorted(lengths))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    if model_path is None:
        tokenizer = build_char_tokenizer()
        master = _tiny_model(tokenizer.vocab_size, seed)
        model_name = "qwen2 hidden=256 layers=4 heads=4 kv_heads=2 intermediate=768, random init (embeddings x0.2)"
    else:
        master, tokenizer = load_pretrained(model_path)
        model_name = model_path
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(len(SPECIAL_TOKENS), tokenizer.vocab_size, (num_samples, prompt_len), generator=generator)
    scored: dict[tuple[str, str], torch.Tensor] = {}
    timings_s: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="jetroll-mismatch-") as tmp:
            published: dict[str, Path] = {}
            for mode in MODES:
                published[mode] = Path(tmp) / mode
                save_pretrained(master, tokenizer, published[mode], publish=Numerics(mode=mode))
            sampler, _ = load_pretrained(published["fp8_unified"], Numerics(mode="fp8_unified"))
            requests = [Request(f"m{i}", row, lengths[-1], ignore_eos=True) for i, row in enumerate(prompts.tolist())]
            started = time.perf_counter()
            Engine(sampler, tokenizer.eos_id, num_samples, prompt_len + lengths[-1], seed=seed).generate(requests)
            timings_s["sample_fast"] = time.perf_counter() - started
            completions = torch.tensor([r.output_ids for r in requests])
            deltas = {mode: _score_both_sides(mode, master, published[mode], prompts, completions, scored, timings_s)
                      for mode in MODES}
    finally:
        torch.set_num_threads(previous_threads)
    rows = []
    for mode in MODES:
        for length in lengths:
            trainer, rollout = deltas[mode]["trainer"][:, :length], deltas[mode]["rollout"][:, :length]
            stats = mismatch_stats(trainer, rollout, torch.ones(trainer.shape, dtype=torch.bool), TIS_CAP, prefix="")
            rows.append({"mode": mode, "length": length, "tokens": int(stats["tokens"]),
                         **{name: stats[name] for name in METRICS}})
    return {
        "config": {
            "model": model_name,
            "lengths": list(lengths), "num_samples": num_samples, "prompt_len": prompt_len, "threads": threads,
            "seed": seed, "tis_cap": TIS_CAP,
            "sampling": "one fp8_unified engine (fast backend), temperature 1, ignore_eos, longest length",
            "scoring": "exact backend; rollout = prefill + batched KV-cache decode from the published checkpoint; "
                       "trainer = no-grad full-sequence pass on fp32 masters; length L = first L completion tokens",
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        },
        "rows": rows,
        "timings_s": timings_s,
        "summary": _summary(rows),
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_mode = {mode: [r for r in rows if r["mode"] == mode] for mode in MODES}
    seq_delta = [r["seq_delta_abs_mean"] for r in by_mode["fp8_rollout_only"]]
    return {
        "unified_max_abs_delta": max(r["abs_max"] for r in by_mode["fp8_unified"]),
        "bf16_max_abs_delta": max(r["abs_max"] for r in by_mode["bf16"]),
        "rollout_only_seq_delta_by_length": seq_delta,
        "rollout_only_seq_delta_is_increasing": all(a < b for a, b in zip(seq_delta[:-1], seq_delta[1:], strict=True)),
        "rollout_only_k3_by_length": [r["k3"] for r in by_mode["fp8_rollout_only"]],
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    table = Table(title=f"training-inference mismatch, {config['num_samples']} samples, delta = logp_trainer - "
                        "logp_rollout (exact backend)")
    for column in ("mode", "length", "mean |d|", "max |d|", "k3", "exp(mean |d|)", "mean |seq sum d|", "TIS clip"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(row["mode"], str(row["length"]), f"{row['abs_mean']:.3e}", f"{row['abs_max']:.3e}",
                      f"{row['k3']:.3e}", f"{row['exp_abs_mean']:.6f}", f"{row['seq_delta_abs_mean']:.3e}",
                      f"{row['tis_clip_frac']:.4f}")
    console = Console()
    console.print(table)
    console.print(json.dumps(result["summary"]))
