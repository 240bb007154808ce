"""The model against Hugging Face transformers on the same saved weights, and its cached decode path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_pretrained, load_state, save_pretrained
from jetroll.shared.model.model import CausalLM, KVCache
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.numerics import Numerics

transformers = pytest.importorskip("transformers")

TOKENIZER = build_char_tokenizer()


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_args(**overrides: object) -> ModelArgs:
    base: dict[str, object] = dict(vocab_size=TOKENIZER.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
                                   num_kv_heads=2, intermediate_size=128, max_position_embeddings=256)
    return ModelArgs(**{**base, **overrides})  # type: ignore[arg-type]


def tiny_model(args: ModelArgs, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(args).eval()
    with torch.no_grad():  # random RMSNorm gains and biases, so a mix-up of names or layouts shows
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0, 0.1)
    return model


def prompt(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, TOKENIZER.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers_qwen2(tmp_path: Path, tied: bool) -> None:
    model = tiny_model(tiny_args(tie_word_embeddings=tied))
    save_pretrained(model, TOKENIZER, tmp_path)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompt()
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0)
    assert hf.config.tie_word_embeddings == tied


def test_llama_config_loads_and_matches_transformers(tmp_path: Path) -> None:
    model = tiny_model(tiny_args(model_type="llama", attention_bias=False, tie_word_embeddings=False))
    save_pretrained(model, TOKENIZER, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded, _ = load_pretrained(tmp_path)
    assert loaded.args.model_type == "llama" and not loaded.args.attention_bias
    ids = prompt()
    with torch.no_grad():
        assert torch.allclose(loaded(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = tiny_model(tiny_args(tie_word_embeddings=False))
    save_pretrained(model, TOKENIZER, tmp_path)
    loaded, tokenizer = load_pretrained(tmp_path)
    assert loaded.args == model.args
    assert tokenizer.eos_id == TOKENIZER.eos_id
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_transformers_save_loads_into_ours(tmp_path: Path) -> None:
    model = tiny_model(tiny_args())
    save_pretrained(model, TOKENIZER, tmp_path / "ours")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "theirs")
    TOKENIZER.save(tmp_path / "theirs")
    loaded, _ = load_pretrained(tmp_path / "theirs")
    ids = prompt()
    with torch.no_grad():
        assert torch.allclose(loaded(ids), model(ids), atol=1e-6, rtol=0)


def test_decode_path_matches_full_forward() -> None:
    model = tiny_model(tiny_args())
    ids, prefill_len = prompt(batch=3, length=20), 8
    cache = KVCache(model.args, num_slots=3, max_len=32)
    with torch.inference_mode():
        full = model(ids)
        for slot in range(3):
            logits = model(ids[slot : slot + 1, :prefill_len], torch.arange(prefill_len), cache, slot=slot)
            assert torch.allclose(logits[0], full[slot, :prefill_len], atol=1e-4, rtol=0)
        for t in range(prefill_len, ids.shape[1]):
            logits = model(ids[:, t : t + 1], torch.full((3,), t), cache)
            assert torch.allclose(logits[:, 0], full[:, t], atol=1e-4, rtol=0)


def test_decode_with_ragged_positions_matches_full_forward() -> None:
    model = tiny_model(tiny_args())
    ids = prompt(batch=2, length=16)
    lengths = [5, 11]  # slot 1 is further along than slot 0: the mask must hide slot 0's stale tail
    cache = KVCache(model.args, num_slots=2, max_len=32)
    with torch.inference_mode():
        full = model(ids)
        for slot, length in enumerate(lengths):
            model(ids[slot : slot + 1, :length], torch.arange(length), cache, slot=slot)
        for step in range(4):
            positions = torch.tensor(lengths) + step
            logits = model(ids[torch.arange(2), positions][:, None], positions, cache)
            expected = full[torch.arange(2), positions]
            assert torch.allclose(logits[:, 0], expected, atol=1e-4, rtol=0)


def test_inference_weights_follow_in_place_updates() -> None:
    model = tiny_model(tiny_args())
    other = tiny_model(tiny_args(), seed=5)
    ids = prompt()
    with torch.no_grad():
        model(ids)  # builds the fused inference weights
        load_state(model, other.state_dict())
        assert torch.allclose(model(ids), other(ids), atol=1e-6, rtol=0)


def test_full_forward_is_differentiable_and_matches_inference() -> None:
    model = tiny_model(tiny_args())
    ids = prompt()
    logits = model(ids)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        assert torch.allclose(model(ids), logits.detach(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["bf16", "fp8_unified"])
def test_precision_modes_differ_from_fp32_but_stay_close(mode: str) -> None:
    args = tiny_args(hidden_size=128, intermediate_size=256)
    reference = tiny_model(args)
    model = CausalLM(args, Numerics(mode=mode)).eval()
    load_state(model, reference.state_dict())
    ids = prompt()
    with torch.no_grad():
        expected, got = reference(ids), model(ids)
    error = (got - expected).abs().max().item()
    assert error > 0
    assert error < 0.05 * expected.abs().max().item()
    logits = model(ids)  # the training path, with straight-through gradients
    logits.mean().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    cache = KVCache(args, num_slots=1, max_len=32)
    with torch.inference_mode():
        decoded = model(ids[:1, :4], torch.arange(4), cache, slot=0)
    assert torch.allclose(decoded[0], got[0, :4], atol=1e-4, rtol=0)
