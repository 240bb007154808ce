"""The precision flow: the quantizer's values, the FP8 backward against a fake-quant reference, the config, and the
exact backend's kernels (batch invariance, decode = full forward, thread count)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.model import exact
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_state
from jetroll.shared.model.model import CausalLM, KVCache
from jetroll.shared.model.precision import FP8_MAX, SCALE_EPS, PrecisionLinear, dequantize, fake_quant, quantize
from jetroll.shared.numerics import Numerics

pytestmark = pytest.mark.usefixtures("one_thread")


def one_block(*values: float) -> torch.Tensor:
    """A 1 x 128 activation group holding `values`, then zeros."""
    x = torch.zeros(1, 128)
    x[0, : len(values)] = torch.tensor(values)
    return x


# quantizer


def test_known_values_are_exact_and_scale_is_amax_over_448() -> None:
    values = (448.0, -448.0, 1.0, 0.5, 3.5, -(2.0**-9), 240.0)  # 2^-9: the smallest e4m3 subnormal
    q, scale_inv = quantize(one_block(*values), 1, 128)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.tolist() == [[1.0]]
    assert q.float()[0, : len(values)].tolist() == list(values)
    q, scale_inv = quantize(one_block(224.0, -0.75, 5.0), 1, 128)
    assert scale_inv.item() == 0.5 and q.float()[0, :3].tolist() == [448.0, -1.5, 10.0]


def test_round_to_nearest_even_on_ties() -> None:
    # scale 1; e4m3 steps are 1/8 in [1, 2), 2 in [16, 32) and 2^-9 among subnormals
    ties = (1.0625, 1.1875, 17.0, 19.0, -1.0625, 1.5 * 2.0**-9, 2.5 * 2.0**-9)
    q, _ = quantize(one_block(448.0, *ties), 1, 128)
    assert q.float()[0, 1 : 1 + len(ties)].tolist() == [1.0, 1.25, 16.0, 20.0, -1.0, 2.0**-8, 2.0**-8]


def test_zero_blocks_quantize_to_zero_with_the_eps_scale() -> None:
    x = torch.zeros(130, 260)
    x[5, 7] = 3.0
    q, scale_inv = quantize(x, 128, 128)
    assert scale_inv.shape == (2, 3)
    assert scale_inv[0, 0].item() == pytest.approx(3.0 / FP8_MAX, rel=1e-7)
    eps_scale = torch.tensor(SCALE_EPS) / FP8_MAX
    assert torch.equal(scale_inv.flatten()[1:], eps_scale.expand(5))
    assert torch.equal(dequantize(q, scale_inv, 128, 128), x)
    assert torch.equal(fake_quant(torch.zeros(3, 128), 1, 128), torch.zeros(3, 128))


def test_padding_is_internal_and_blocks_see_only_their_values() -> None:
    x = torch.randn(130, 200, generator=torch.Generator().manual_seed(0))
    q, scale_inv = quantize(x, 128, 128)
    assert q.shape == (130, 200) and scale_inv.shape == (2, 2)
    for (rows, cols), scale in zip(
        [(slice(0, 128), slice(0, 128)), (slice(0, 128), slice(128, 200)), (slice(128, 130), slice(0, 128)),
         (slice(128, 130), slice(128, 200))], scale_inv.flatten().tolist(), strict=True):
        assert scale == pytest.approx(x[rows, cols].abs().max().item() / FP8_MAX, rel=1e-7)
    error = (dequantize(q, scale_inv, 128, 128) - x).abs()
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 relative; subnormals step by 2^-9 of the scale
    scales = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :200]
    assert (error <= torch.maximum(x.abs() * 2.0**-4, scales * 2.0**-10) * (1 + 1e-6)).all()
    by_row = torch.cat([quantize(x[i : i + 1, :150], 1, 128)[0] for i in range(130)])
    assert torch.equal(quantize(x[:, :150], 1, 128)[0].float(), by_row.float())  # activation groups: per row


def test_clamp_at_448_when_the_scale_rounds_down() -> None:
    # amax / fl(amax / 448) can land just above 448 in fp32: such values must saturate to 448, never NaN
    candidates = torch.rand(20000, generator=torch.Generator().manual_seed(1)) * 1000 + 1
    scales = candidates / FP8_MAX
    overshoot = candidates[candidates / scales > FP8_MAX]
    assert overshoot.numel() > 0
    for value in overshoot[:20].tolist():
        q, _ = quantize(one_block(value, -value, 1.0), 1, 128)
        assert q.float()[0, :2].tolist() == [FP8_MAX, -FP8_MAX]
    q, _ = quantize(torch.tensor([[1e30, -1e30, 3e38]]), 1, 3)
    assert not q.float().isnan().any() and q.float().abs().max().item() == FP8_MAX


def test_pow2_scales_are_the_next_power_of_two() -> None:
    x = torch.randn(300, 260, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 3, 260)
    _, plain = quantize(x, 128, 128)
    q, pow2 = quantize(x, 128, 128, pow2=True)
    mantissa, _ = torch.frexp(pow2)
    assert (mantissa == 0.5).all()  # powers of two
    assert (pow2 >= plain).all() and (pow2 < 2 * plain).all()
    assert q.float().abs().max().item() <= FP8_MAX
    assert quantize(one_block(448.0), 1, 128, pow2=True)[1].item() == 1.0  # already a power of two: kept
    assert quantize(one_block(449.0), 1, 128, pow2=True)[1].item() == 2.0


# backward


def linear_and_grads(config: Numerics, seed: int = 3) -> tuple[PrecisionLinear, torch.Tensor, torch.Tensor]:
    """A 200 -> 150 linear (partial blocks everywhere) on 3 x 50 tokens (2 token groups, one partial)."""
    torch.manual_seed(seed)
    linear = PrecisionLinear(200, 150, True, config, "down_proj")
    x = torch.randn(3, 50, 200, requires_grad=True)
    grad_out = torch.randn(3, 50, 150)
    linear(x).backward(grad_out)
    return linear, x, grad_out


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_backward_matches_the_fake_quant_reference(pow2: bool) -> None:
    config = Numerics(mode="fp8_unified", backward="fp8", scale_rounding="pow2" if pow2 else "none")
    linear, x, grad_out = linear_and_grads(config)
    x2, dy = x.detach().reshape(-1, 200), grad_out.reshape(-1, 150)
    w_hat = fake_quant(linear.weight.detach(), 128, 128, pow2)
    # DGrad = Q1x128(dY) W128x128; WGrad = Q1x128(dY^T) Q128x1(X): groups along each GEMM's reduction dim
    dx = fake_quant(dy, 1, 128, pow2) @ w_hat
    dw = fake_quant(dy.t(), 1, 128, pow2) @ fake_quant(x2, 128, 1, pow2)
    assert torch.allclose(x.grad.reshape(-1, 200), dx, rtol=0, atol=1e-5)
    assert torch.allclose(linear.weight.grad, dw, rtol=0, atol=1e-5)
    assert torch.allclose(linear.bias.grad, dy.sum(0), rtol=0, atol=1e-5)
    # the quantization is really in the backward: the straight-through fp32 gradient differs
    straight = dy.t() @ fake_quant(x2, 1, 128, pow2)
    assert (linear.weight.grad - straight).abs().max().item() > 1e-3


def test_bf16_backward_rounds_dy_and_the_forward_operands() -> None:
    linear, x, grad_out = linear_and_grads(Numerics(mode="fp8_unified", backward="bf16"))
    x2, dy = x.detach().reshape(-1, 200), grad_out.reshape(-1, 150)
    bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    dy16, w_hat = bf16(dy), fake_quant(linear.weight.detach(), 128, 128)
    assert torch.allclose(x.grad.reshape(-1, 200), dy16 @ bf16(w_hat), rtol=0, atol=1e-5)
    assert torch.allclose(linear.weight.grad, dy16.t() @ bf16(fake_quant(x2, 1, 128)), rtol=0, atol=1e-5)


def test_forward_of_the_gradient_pass_uses_the_published_fp8_weight() -> None:
    config = Numerics(mode="fp8_unified")
    linear, x, _ = linear_and_grads(config)
    q, scale_inv = linear.quantized()
    x_hat = fake_quant(x.detach().reshape(-1, 200), 1, 128).view(x.shape)
    expected = F.linear(x_hat, dequantize(q, scale_inv, 128, 128), linear.bias)
    assert torch.equal(linear(x).detach(), expected)
    with torch.no_grad():
        assert torch.allclose(linear(x), expected, rtol=0, atol=1e-5)  # inference path (fused, maybe prepacked)


# config


def test_precision_config_modes_and_checks() -> None:
    for mode in ("fp32", "bf16", "fp8_unified", "fp8_rollout_only"):
        assert PrecisionConfig(mode=mode).mode == mode
    rollout_only = PrecisionConfig(mode="fp8_rollout_only").numerics()
    assert rollout_only.trainer_side().mode == "bf16" and rollout_only.linear_format("q_proj") == "fp8"
    unified = PrecisionConfig(mode="fp8_unified", high_precision=["gate_proj", "up_proj"]).numerics()
    assert unified.trainer_side() is unified and unified == Numerics(mode="fp8_unified",
                                                                      high_precision=("gate_proj", "up_proj"))
    assert [unified.linear_format(n) for n in ("q_proj", "gate_proj", "down_proj")] == ["fp8", "bf16", "fp8"]
    ids = {PrecisionConfig(**kw).precision_id("plan") for kw in (
        {}, {"mode": "bf16"}, {"mode": "bf16", "backend": "exact"}, {"mode": "fp8_unified"},
        {"mode": "fp8_unified", "backward": "bf16"}, {"mode": "fp8_unified", "scale_rounding": "pow2"})}
    assert len(ids) == 6
    with pytest.raises(ValueError, match="q_proj"):
        PrecisionConfig(high_precision=["q_proj"])
    with pytest.raises(ValueError, match="act_group"):
        PrecisionConfig(act_group=96)
    with pytest.raises(ValueError):
        PrecisionConfig(backend="gpu")


# exact backend


def test_exp_and_log_are_accurate() -> None:
    x = torch.linspace(-700, 700, 100001, dtype=torch.float64)
    assert ((exact.exp(x) - torch.exp(x)).abs() / torch.exp(x)).max().item() < 1e-15
    y = torch.logspace(-300, 300, 100001, dtype=torch.float64)
    assert (exact.log(y) - torch.log(y)).abs().max().item() < 1e-12


def test_fold_sum_ignores_appended_zeros() -> None:
    x = torch.randn(4, 5, dtype=torch.float64) * torch.logspace(-8, 8, 5, dtype=torch.float64)
    base = exact.fold_sum(x, dim=1)
    for width in (6, 8, 9, 16, 33):
        assert torch.equal(exact.fold_sum(F.pad(x, (0, width - 5)), dim=1), base)
    assert torch.equal(exact.fold_sum(x.t().contiguous(), dim=0), base)


def test_exact_fp8_block_sums_equal_the_true_sum() -> None:
    x = torch.randn(7, 384, generator=torch.Generator().manual_seed(4))
    w = torch.randn(96, 384, generator=torch.Generator().manual_seed(5))
    qx, sx = quantize(x, 1, 128)
    qw, sw = quantize(w, 128, 128)
    rows = sw.double().repeat_interleave(128, 0)[:96]
    got = exact.block_matmul(qx.double(), sx.double(), qw.double(), rows, 128)
    # each 128-block sum of e4m3 products is exact: compare with per-block fp64 sums, scaled and added in order
    partial = torch.einsum("mbk,nbk->bmn", qx.double().view(7, 3, 128), qw.double().view(96, 3, 128))
    scaled = partial * sx.double().t()[:, :, None] * rows.t()[:, None, :]
    assert torch.equal(got, (scaled[0] + scaled[2]) + scaled[1])


def exact_model(mode: str) -> CausalLM:
    args = ModelArgs(vocab_size=40, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=320,
                     max_position_embeddings=256)
    torch.manual_seed(0)
    reference = CausalLM(args)
    model = CausalLM(args, Numerics(mode=mode, backend="exact")).eval()
    load_state(model, reference.state_dict())
    return model


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp8_unified"])
def test_exact_forward_is_batch_invariant_and_decode_equals_full(mode: str) -> None:
    model = exact_model(mode)
    ids = torch.randint(0, 40, (3, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids)
        for i in range(3):
            assert torch.equal(model(ids[i : i + 1, :11]), full[i : i + 1, :11])  # alone, shorter
        padded = torch.cat([ids, torch.zeros(3, 9, dtype=torch.long)], dim=1)  # right padding
        assert torch.equal(model(padded)[:, :24], full)
        torch.set_num_threads(2)
        try:
            assert torch.equal(model(ids), full)
        finally:
            torch.set_num_threads(1)
    cache = KVCache(model.args, num_slots=3, max_len=32)
    lengths = [5, 9, 7]  # ragged: every slot sees other slots' stale cache positions
    with torch.inference_mode():
        for slot, length in enumerate(lengths):
            logits = model(ids[slot : slot + 1, :length], torch.arange(length), cache, slot=slot)
            assert torch.equal(logits[0], full[slot, :length])
        for step in range(12):
            positions = torch.tensor(lengths) + step
            logits = model(ids[torch.arange(3), positions][:, None], positions, cache)
            assert torch.equal(logits[:, 0], full[torch.arange(3), positions])
    with torch.enable_grad():  # the gradient pass runs `fast`, close to exact
        assert torch.allclose(model(ids), full, rtol=0, atol=0.3 if mode == "fp8_unified" else 0.05)


def test_exact_log_softmax_is_row_invariant() -> None:
    logits = torch.randn(33, 55, generator=torch.Generator().manual_seed(7)) * 4
    rows = exact.log_softmax(logits)
    assert torch.allclose(rows, torch.log_softmax(logits, -1), rtol=0, atol=2e-6)
    assert all(torch.equal(exact.log_softmax(logits[i : i + 1]), rows[i : i + 1]) for i in range(33))
