"""Acceptance: on the exact backend, every behaviour log-prob the rollout engine records equals, bitwise, the trainer's
no-grad log-prob at the same version. The trainer's side runs in another process, from the published checkpoint
bytes, in another batch composition with extra padding; recorded log-probs are never reused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_pretrained, save_pretrained
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import SPECIAL_TOKENS, build_char_tokenizer
from jetroll.shared.numerics import Numerics

TOKENIZER = build_char_tokenizer()
SCORER = Path(__file__).with_name("bitwise_scorer.py")
REPO = Path(__file__).resolve().parents[3]


pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]  # a scorer subprocess


def tiny_model(seed: int) -> CausalLM:
    """Two 128-blocks along the hidden dim, and a 320-wide MLP: partial blocks in both GEMM dims."""
    args = ModelArgs(vocab_size=TOKENIZER.vocab_size, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=320, max_position_embeddings=4096, eos_token_id=TOKENIZER.eos_id)
    torch.manual_seed(seed)
    model = CausalLM(args)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.2)  # softer softmaxes, so sampling samples
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    return model


def publish(model: CausalLM, precision: Numerics, directory: Path) -> Path:
    save_pretrained(model, TOKENIZER, directory, publish=precision)
    return directory


def score_in_subprocess(tmp_path: Path, requests: list[Request], checkpoints: dict[int, Path],
                        precision: Numerics, temperature: float) -> dict[str, torch.Tensor]:
    lengths = [r.num_tokens for r in requests]
    ids = torch.zeros(len(requests), max(lengths), dtype=torch.long)
    for i, request in enumerate(requests):
        ids[i, : lengths[i]] = torch.tensor(request.prompt_ids + request.output_ids)
    save_file({"ids": ids, "lengths": torch.tensor(lengths)}, str(tmp_path / "sequences.safetensors"))
    job = {"checkpoints": {str(v): str(d) for v, d in checkpoints.items()}, "precision": dataclasses.asdict(precision),
           "sequences": str(tmp_path / "sequences.safetensors"), "out": str(tmp_path / "scored.safetensors"),
           "micro_batch": 5, "extra_pad": 7, "temperature": temperature, "threads": 1}
    (tmp_path / "job.json").write_text(json.dumps(job))
    subprocess.run([sys.executable, str(SCORER), str(tmp_path / "job.json")], cwd=REPO, check=True, timeout=600)
    return load_file(str(tmp_path / "scored.safetensors"))


def assert_bitwise(requests: list[Request], scored: dict[str, torch.Tensor]) -> int:
    num_tokens = 0
    for i, request in enumerate(requests):
        start = len(request.prompt_ids) - 1  # logits at position t score token t + 1
        for version in sorted(set(request.versions)):
            columns = [start + j for j, v in enumerate(request.versions) if v == version]
            recorded = torch.tensor([request.logprobs[j] for j, v in enumerate(request.versions) if v == version],
                                    dtype=torch.float32)
            trainer = scored[f"v{version}"][i, columns]
            mismatch = (recorded != trainer).nonzero()
            assert mismatch.numel() == 0, (
                f"request {i} v{version}: {mismatch.numel()} of {len(columns)} tokens differ, first at "
                f"{int(mismatch[0])}: rollout {recorded[mismatch[0]].item()!r} trainer {trainer[mismatch[0]].item()!r}")
            num_tokens += len(columns)
    return num_tokens


@pytest.mark.parametrize(("mode", "temperature"), [("fp8_unified", 1.0), ("bf16", 0.7)])
def test_rollout_logprobs_equal_trainer_bitwise_for_batch_sizes_1_to_64(
    tmp_path: Path, mode: str, temperature: float
) -> None:
    precision = Numerics(mode=mode, backend="exact")
    checkpoint = publish(tiny_model(seed=0), precision, tmp_path / "v0")
    model, _ = load_pretrained(checkpoint, precision)
    engine = Engine(model, TOKENIZER.eos_id, max_batch=64, max_len=256, seed=1, compile=True)
    assert engine.decode_fn == model.decode and engine.compile_s == 0  # exact never takes the compiled path
    # sequence i stops at 256 - 3i tokens, so the decode batch runs through every size from 64 down to 1
    requests = []
    for i in range(64):
        prompt = torch.randint(len(SPECIAL_TOKENS), TOKENIZER.vocab_size, (3 + i % 5,),
                               generator=torch.Generator().manual_seed(i)).tolist()
        requests.append(Request(f"r{i}", prompt, 256 - 3 * i - len(prompt), temperature, ignore_eos=True))
    batch_sizes = set()
    engine.add(requests)
    while engine.has_work:
        batch_sizes.add(len(engine.running))
        engine.step()
    assert batch_sizes >= set(range(1, 65))
    assert max(r.num_tokens for r in requests) == 256
    scored = score_in_subprocess(tmp_path, requests, {0: checkpoint}, precision, temperature)
    assert assert_bitwise(requests, scored) == sum(len(r.output_ids) for r in requests)


@pytest.mark.slow  # about a minute: 2 x 2048 exact decode steps, then two 2048-token trainer passes
def test_bitwise_at_length_2048_across_a_weight_swap(tmp_path: Path) -> None:
    precision = Numerics(mode="fp8_unified", backend="exact")
    old, new = tiny_model(seed=0), tiny_model(seed=0)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    checkpoints = {0: publish(old, precision, tmp_path / "v0"), 1: publish(new, precision, tmp_path / "v1")}
    model, _ = load_pretrained(checkpoints[0], precision)
    engine = Engine(model, TOKENIZER.eos_id, max_batch=2, max_len=2048, seed=2)
    prompts = [TOKENIZER.encode("12+34="), TOKENIZER.encode("987-654+3=")]
    requests = [Request(f"s{i}", p, 2048 - len(p), ignore_eos=True) for i, p in enumerate(prompts)]
    engine.add(requests)
    while len(requests[0].output_ids) < 1000:
        engine.step()
    # what a rollout worker does with a newer version: the published bytes, swapped in at a token boundary
    engine.swap_weights(load_file(str(checkpoints[1] / "model.safetensors")), version=1)
    while engine.has_work:
        engine.step()
    assert all(r.num_tokens == 2048 and 0 in r.versions and 1 in r.versions for r in requests)
    scored = score_in_subprocess(tmp_path, requests, checkpoints, precision, 1.0)
    assert assert_bitwise(requests, scored) == 2 * 2048 - sum(len(p) for p in prompts)
