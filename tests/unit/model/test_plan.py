"""The quantization plan: what each precision mode does to each parameter, that the trainer's own published tensors
follow it, and the first difference it names when a plan or a tensor does not."""

from __future__ import annotations

import msgspec
import pytest
import torch

from jetroll.shared.config.model import ModelConfig
from jetroll.shared.model.checkpoint import pretrained_tensors, quantization_plan
from jetroll.shared.model.init import init_weights, model_args
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.numerics import MASTERS, Numerics, QuantizationPlan

ARGS = model_args(ModelConfig(num_layers=2, intermediate_size=256), build_char_tokenizer())
GATE = "model.layers.0.mlp.gate_proj.weight"


def formats(plan: QuantizationPlan, suffix: str) -> set[str]:
    return {fmt for name, fmt in plan.params.items() if name.endswith(suffix)}


@pytest.mark.parametrize(("precision", "linears"), [
    (Numerics(), {"fp32"}),
    (Numerics(mode="bf16"), {"bf16"}),
    (Numerics(mode="fp8_unified"), {"e4m3[128x128]"}),
    (Numerics(mode="fp8_rollout_only"), {"e4m3[128x128]"}),  # the published side is rollout's FP8
    (Numerics(mode="fp8_unified", weight_block=64, act_group=32), {"e4m3[64x64]"}),
])
def test_each_mode_plans_its_block_linears_and_keeps_the_rest_fp32(precision: Numerics, linears: set[str]) -> None:
    plan = quantization_plan(ARGS, precision)
    assert plan.source == MASTERS and plan.activation_group == precision.act_group
    for linear in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight"):
        assert formats(plan, linear) == linears, linear
    assert formats(plan, "norm.weight") == formats(plan, "embed_tokens.weight") == formats(plan, "bias") == {"fp32"}
    # a tied lm_head is the embedding: it is published once
    assert ("lm_head.weight" in plan.params) != ARGS.tie_word_embeddings


def test_exclusions_and_scale_rounding_are_in_the_plan_and_its_digest() -> None:
    plain = quantization_plan(ARGS, Numerics(mode="fp8_unified"))
    excluded = quantization_plan(ARGS, Numerics(mode="fp8_unified", high_precision=("gate_proj", "up_proj")))
    assert formats(excluded, "gate_proj.weight") == formats(excluded, "up_proj.weight") == {"bf16"}
    assert formats(excluded, "down_proj.weight") == {"e4m3[128x128]"}
    assert plain.first_difference(excluded, "the trainer's", "the worker's") == (
        f"{GATE} is e4m3[128x128] in the trainer's and bf16 in the worker's")
    pow2 = quantization_plan(ARGS, Numerics(mode="fp8_unified", scale_rounding="pow2"))
    assert pow2.scale_format == "ue8m0" and plain.scale_format == "fp32"
    assert plain.first_difference(pow2, "a", "b") == "scale_format is fp32 in a and ue8m0 in b"
    assert len({plain.digest, excluded.digest, pow2.digest}) == 3
    assert plain.first_difference(quantization_plan(ARGS, Numerics(mode="fp8_unified")), "a", "b") is None
    assert plain.digest == quantization_plan(ARGS, Numerics(mode="fp8_unified")).digest


@pytest.mark.parametrize("precision", [
    Numerics(), Numerics(mode="bf16"), Numerics(mode="fp8_unified"),
    Numerics(mode="fp8_unified", high_precision=("gate_proj", "up_proj"), scale_rounding="pow2"),
])
def test_the_trainers_published_tensors_follow_its_plan(precision: Numerics) -> None:
    torch.manual_seed(0)
    model = CausalLM(ARGS, precision)
    init_weights(model)
    tensors, _ = pretrained_tensors(model, publish=precision)
    assert quantization_plan(ARGS, precision).check_tensors(tensors) is None


def test_tensors_that_break_the_plan_are_named() -> None:
    torch.manual_seed(0)
    model = CausalLM(ARGS, Numerics(mode="fp8_unified"))
    init_weights(model)
    tensors, _ = pretrained_tensors(model, publish=Numerics(mode="fp8_unified"))
    plan = quantization_plan(ARGS, Numerics(mode="fp8_unified"))
    bf16 = dict(tensors, **{GATE: torch.zeros(256, ARGS.hidden_size, dtype=torch.bfloat16)})
    assert plan.check_tensors(bf16) == (f"{GATE} is torch.bfloat16 with scales (2, 1), and its plan says "
                                        "e4m3[128x128] with scales (2, 1)")
    no_scales = {k: v for k, v in tensors.items() if k != GATE.replace("weight", "weight_scale_inv")}
    assert plan.check_tensors(no_scales) == (f"{GATE} is torch.float8_e4m3fn with no scales, and its plan says "
                                             "e4m3[128x128] with scales (2, 1)")
    assert plan.check_tensors({k: v for k, v in tensors.items() if k != GATE}) == f"{GATE} is missing"
    assert plan.check_tensors(dict(tensors, extra=torch.zeros(1))) == "extra is not in the plan"
    fp32 = quantization_plan(ARGS, Numerics())
    assert fp32.check_tensors(tensors) == ("model.layers.0.self_attn.q_proj.weight is torch.float8_e4m3fn, and its "
                                           "plan says fp32")


def test_a_plan_with_a_field_it_does_not_know_is_refused() -> None:
    plan = quantization_plan(ARGS, Numerics(mode="fp8_unified"))
    raw = msgspec.json.encode(plan)
    assert msgspec.json.decode(raw, type=QuantizationPlan) == plan
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(raw[:-1] + b',"exclusions":["gate_proj"]}', type=QuantizationPlan)


def test_a_misaligned_refit_quantizes_a_bf16_copy_and_its_plan_says_so() -> None:
    """`refit_source: bf16_copy` (the fault the mismatch gates are tested with): the base is quantized from the
    masters, every later version from a bf16 copy of them; the plan names the source, so both sides agree on it."""
    misaligned = Numerics(mode="fp8_unified", refit_source="bf16_copy")
    torch.manual_seed(0)
    model = CausalLM(ARGS, misaligned)
    init_weights(model)
    aligned_refit, _ = pretrained_tensors(model, publish=Numerics(mode="fp8_unified"), is_refit=True)
    base, _ = pretrained_tensors(model, publish=misaligned)
    refit, _ = pretrained_tensors(model, publish=misaligned, is_refit=True)
    scales = GATE.replace("weight", "weight_scale_inv")
    assert torch.equal(base[GATE].view(torch.uint8), aligned_refit[GATE].view(torch.uint8))
    assert not (torch.equal(refit[GATE].view(torch.uint8), aligned_refit[GATE].view(torch.uint8))
                and torch.equal(refit[scales], aligned_refit[scales]))
    plan = quantization_plan(ARGS, misaligned)
    assert plan.source == "bf16_copy" and plan.check_tensors(refit) is None
    assert plan.first_difference(quantization_plan(ARGS, Numerics(mode="fp8_unified")), "a", "b") == (
        "source is bf16_copy in a and fp32_masters in b")
    with pytest.raises(ValueError, match="refit_source"):
        Numerics(refit_source="bf16_copy")
