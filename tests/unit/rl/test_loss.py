"""Numeric checks of shared/rl/loss.py against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.config.trainer import TrainerConfig
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.model import CausalLM
from jetroll.shared.rl.loss import group_advantages, ppo_loss, token_entropy, token_logprobs
from jetroll.shared.rl.passes import gradient_rows, policy_width


def _cfg(**kw: object) -> TrainerConfig:
    base = {"clip_eps": 0.2, "clip_eps_high": 0.28, "dual_clip_c": 3.0}
    base.update(kw)
    return TrainerConfig(**base)


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def _grad(
    logp: torch.Tensor,
    prox: torch.Tensor,
    beh: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: TrainerConfig,
    **kw: object,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    kw.setdefault("correction", PrecisionConfig())
    loss, stats = ppo_loss(logp, prox, beh, adv, mask, cfg, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, stats


# ---------------------------------------------------------------- advantages


def test_grpo_advantages_zero_mean_unit_std() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [0.3, 2.0, -1.0, 0.5, 0.0]])
    adv = group_advantages(rewards, "grpo")
    assert adv.shape == rewards.shape
    torch.testing.assert_close(adv.mean(dim=-1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.std(dim=-1, unbiased=False), torch.ones(2), atol=1e-4, rtol=0)


def test_constant_reward_group_gets_zero_advantage() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    for kind in ("grpo", "dr_grpo"):
        adv = group_advantages(rewards, kind)
        assert torch.all(adv[:2] == 0)
        assert torch.isfinite(adv).all()
    # group_size 1 is a constant group too (no NaN from the std)
    assert torch.all(group_advantages(torch.tensor([[3.0], [5.0]]), "grpo") == 0)


def test_dr_grpo_advantage_is_centered_not_scaled() -> None:
    rewards = torch.tensor([[0.0, 1.0, 1.0, 2.0]])
    torch.testing.assert_close(group_advantages(rewards, "dr_grpo"), torch.tensor([[-1.0, 0.0, 0.0, 1.0]]))


# ---------------------------------------------------------------- ppo loss


def test_on_policy_gradient_is_minus_advantage_over_num_tokens() -> None:
    logp = _leaf([[-0.5, -1.2, -2.0], [-0.1, -0.7, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.7, -1.3])
    loss, grad, stats = _grad(logp, logp.detach(), logp.detach(), adv, mask, _cfg())
    n = 5.0
    expected = -adv[:, None] * mask / n
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(loss, (-(adv[:, None] * mask).sum() / n))
    assert stats["num_tokens"] == n
    assert stats["clip_frac"] == 0.0 and stats["band_masked_frac"] == 0.0
    assert stats["policy_lag_k3"] == pytest.approx(0.0, abs=1e-7)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert stats["is_weight_mean"] == pytest.approx(1.0) and stats["is_weight_max"] == pytest.approx(1.0)


def test_per_token_advantages_accepted() -> None:
    logp = _leaf([[-0.5, -1.2]])
    adv = torch.tensor([[2.0, -1.0]])
    _, grad, _ = _grad(logp, logp.detach(), logp.detach(), adv, torch.ones(1, 2), _cfg())
    torch.testing.assert_close(grad, -adv / 2)


@pytest.mark.parametrize(
    ("ratio", "adv", "has_grad"),
    [
        (1.10, 1.0, True),  # inside the clip range
        (1.50, 1.0, False),  # above 1 + eps_high with A > 0: clipped
        (1.27, 1.0, True),  # just inside the asymmetric high bound
        (0.50, 1.0, True),  # below 1 - eps with A > 0: unclipped side is the min
        (0.50, -1.0, False),  # below 1 - eps with A < 0: clipped
        (0.85, -1.0, True),
        (1.50, -1.0, True),  # above the range with A < 0: unclipped is the min (pessimistic)
    ],
)
def test_clipping_stops_gradient_beyond_bounds(ratio: float, adv: float, has_grad: bool) -> None:
    logp = _leaf([[-1.0]])
    prox = logp.detach() - math.log(ratio)
    _, grad, stats = _grad(logp, prox, prox, torch.tensor([adv]), torch.ones(1, 1), _cfg())
    if has_grad:
        torch.testing.assert_close(grad, torch.tensor([[-adv * ratio]]))
        assert stats["clip_frac"] == 0.0
    else:
        assert grad.item() == 0.0
        assert stats["clip_frac"] == 1.0


def test_dual_clip_bounds_loss_for_negative_advantage() -> None:
    cfg = _cfg(dual_clip_c=3.0)
    adv = torch.tensor([-2.0])
    logp = _leaf([[-1.0]])
    prox = logp.detach() - math.log(10.0)  # ratio 10 >> c
    loss, grad, stats = _grad(logp, prox, prox, adv, torch.ones(1, 1), cfg)
    assert loss.item() == pytest.approx(3.0 * 2.0)  # -c * A, not -r * A = 20
    assert grad.item() == 0.0
    assert stats["dual_clip_frac"] == 1.0
    # below c the ordinary (unclipped, pessimistic) loss -r * A applies
    prox = logp.detach() - math.log(2.5)
    loss, grad, stats = _grad(logp, prox, prox, adv, torch.ones(1, 1), cfg)
    assert loss.item() == pytest.approx(2.5 * 2.0, rel=1e-5)
    assert grad.item() == pytest.approx(2.5 * 2.0, rel=1e-5)
    assert stats["dual_clip_frac"] == 0.0
    # a positive advantage is never dual-clipped: ratio 10 just clips at 1 + eps_high
    prox = logp.detach() - math.log(10.0)
    loss, _, stats = _grad(logp, prox, prox, torch.tensor([2.0]), torch.ones(1, 1), cfg)
    assert loss.item() == pytest.approx(-1.28 * 2.0, rel=1e-5)
    assert stats["dual_clip_frac"] == 0.0


def test_behavior_weight_is_capped_and_detached() -> None:
    cfg = _cfg()
    correction = PrecisionConfig(correction_cap=2.0, decoupled_band=(0.0, 10.0))
    logp = _leaf([[-1.0, -1.0]])
    prox = logp.detach()
    beh = prox - torch.tensor([[math.log(5.0), math.log(1.5)]])  # pi_prox / mu = 5 and 1.5
    adv = torch.tensor([1.0])
    loss, grad, stats = _grad(logp, prox, beh, adv, torch.ones(1, 2), cfg, correction=correction)
    torch.testing.assert_close(grad, torch.tensor([[-2.0 / 2, -1.5 / 2]]))  # cap C = 2 on the first
    assert loss.item() == pytest.approx(-(2.0 + 1.5) / 2)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    assert stats["is_weight_mean"] == pytest.approx(1.75)
    assert stats["is_ratio_max"] == pytest.approx(5.0, rel=1e-5)
    assert stats["is_capped_frac"] == 0.5
    # gradient flows only through logp: prox / behaviour log-probs are stop-grad
    prox_g = prox.clone().requires_grad_(True)
    loss2, _ = ppo_loss(logp, prox_g, beh, adv, torch.ones(1, 2), cfg, correction=correction)
    loss2.backward()
    assert prox_g.grad is None or torch.all(prox_g.grad == 0)


def test_band_masking_counted_and_denominator_counts_before_band() -> None:
    cfg = _cfg()
    correction = PrecisionConfig(decoupled_band=(0.5, 10.0), correction_cap=100.0)
    logp = _leaf([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    prox = logp.detach()
    ratios = torch.tensor([[1.0, 20.0, 0.2, 1.0, 50.0]])  # 20 and 0.2 leave the band; last is mask 0
    beh = prox - ratios.log()
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0])
    loss, grad, stats = _grad(logp, prox, beh, adv, mask, cfg, correction=correction)
    # only tokens 0 and 3 contribute, but the denominator is all 4 loss_mask tokens
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 0.0, 0.0, -0.25, 0.0]]))
    assert loss.item() == pytest.approx(-2 / 4)
    assert stats["num_tokens"] == 4.0
    assert stats["band_masked_tokens"] == 2.0
    assert stats["band_masked_frac"] == pytest.approx(0.5)


def test_dr_grpo_constant_denominator() -> None:
    logp = _leaf([[-1.0, -2.0, -0.5], [-0.3, -0.3, -0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -0.5])
    denom = 2 * 16.0  # batch x max_new_tokens
    loss, grad, stats = _grad(
        logp, logp.detach(), logp.detach(), adv, mask, _cfg(), denominator=denom
    )
    torch.testing.assert_close(grad, -adv[:, None] * mask / denom)
    assert loss.item() == pytest.approx(-(1.0 + 1.0 - 0.5) / denom)
    assert stats["num_tokens"] == 3.0


def test_policy_lag_k3_and_reference_kl() -> None:
    logp = _leaf([[-1.0, -2.0]])
    prox = logp.detach()
    delta = torch.tensor([[0.3, -0.2]])  # behavior_logp - prox_logp
    beh = prox + delta
    mask = torch.ones(1, 2)
    expected_lag = float((delta.exp() - 1 - delta).mean())
    _, stats = ppo_loss(logp, prox, beh, torch.tensor([0.0]), mask, _cfg(),
                        correction=PrecisionConfig(correction_cap=10.0))
    assert stats["policy_lag_k3"] == pytest.approx(expected_lag, rel=1e-5)
    # with A = 0 the loss is only the reference KL (k3), so its value and gradient are explicit
    ref = prox + torch.tensor([[0.5, -0.4]])
    d = ref - prox
    for coef, kw in ((0.1, {"ref_logp": ref}), (0.0, {"ref_logp": ref}), (0.1, {})):
        loss, grad, stats = _grad(logp, prox, prox, torch.tensor([0.0]), mask, _cfg(kl_coef=coef), **kw)
        if coef > 0 and kw:
            assert loss.item() == pytest.approx(float(coef * (d.exp() - 1 - d).sum() / 2), rel=1e-5)
            # d/dlogp of exp(ref - logp) - 1 - (ref - logp) = 1 - exp(ref - logp)
            torch.testing.assert_close(grad, coef * (1 - d.exp()) / 2)
            assert stats["kl_ref"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-5)
        else:
            assert loss.item() == 0.0 and "kl_ref" not in stats


def test_padding_garbage_does_not_poison_loss() -> None:
    logp = _leaf([[-1.0, -1.0]])
    prox = torch.tensor([[-1.0, float("inf")]])
    beh = torch.tensor([[-1.0, float("-inf")]])
    loss, grad, stats = _grad(logp, prox, beh, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), _cfg())
    assert loss.item() == pytest.approx(-1.0)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0]]))
    assert all(math.isfinite(v) for v in stats.values())


# ---------------------------------------------------------------- token log-probs


def _manual_logprobs(logits: torch.Tensor, targets: torch.Tensor, temps: list[float]) -> torch.Tensor:
    out = torch.empty(targets.shape, dtype=torch.float64)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            z = logits[b, t].double() / temps[b]
            out[b, t] = z[targets[b, t]] - math.log(sum(math.exp(v) for v in z.tolist()))
    return out.float()


def test_token_logprobs_with_temperature() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g) * 3
    targets = torch.randint(0, 7, (2, 3), generator=g)
    out = token_logprobs(logits, targets, 0.7)
    assert out.shape == (2, 3) and out.dtype == torch.float32
    torch.testing.assert_close(out, _manual_logprobs(logits, targets, [0.7, 0.7]))
    per_seq = token_logprobs(logits, targets, torch.tensor([0.5, 1.3]))
    torch.testing.assert_close(per_seq, _manual_logprobs(logits, targets, [0.5, 1.3]))


def test_token_entropy_of_known_distributions() -> None:
    """Nats: p = (1/2, 1/4, 1/4) has 1.5 ln 2; at T = 2 the logits halve; uniform has ln V; p = (1, 0) has 0."""
    logits = torch.tensor([[[math.log(4.0), math.log(2.0), math.log(2.0)]] * 2])  # [1, 2, 3]
    torch.testing.assert_close(token_entropy(logits, 1.0), torch.full((1, 2), 1.5 * math.log(2.0)))
    p = torch.tensor([2.0, math.sqrt(2.0), math.sqrt(2.0)])
    p = p / p.sum()  # softmax(logits / 2)
    per_row = token_entropy(logits.expand(2, 2, 3), torch.tensor([1.0, 2.0]))  # a temperature per sequence
    torch.testing.assert_close(per_row[:, 0], torch.tensor([1.5 * math.log(2.0), float(-(p * p.log()).sum())]))
    assert token_entropy(torch.zeros(1, 1, 7), 0.7).item() == pytest.approx(math.log(7.0))
    certain = token_entropy(torch.tensor([[[0.0, -math.inf], [50.0, 0.0]]]), 1.0)
    assert certain[0, 0].item() == 0.0 and 0 <= certain[0, 1].item() < 1e-18


def test_token_entropy_gradient_is_analytic_and_finite_at_zero_probability() -> None:
    """dH/dz_i = -p_i (log p_i + H) (the entropy bonus ascends it); a -inf logit (p = 0) gets 0, not nan."""
    logits = _leaf([[0.3, -1.2, 2.0, -math.inf]])
    token_entropy(logits.unsqueeze(0), 1.0).sum().backward()
    p = torch.softmax(logits.detach(), dim=-1)[0, :3]
    entropy = -(p * p.log()).sum()
    torch.testing.assert_close(logits.grad[0, :3], -p * (p.log() + entropy))
    assert logits.grad[0, 3].item() == 0.0


def test_token_logprobs_fp32_from_bf16_logits() -> None:
    logits = (torch.randn(1, 4, 11, generator=torch.Generator().manual_seed(1)) * 5).bfloat16()
    targets = torch.tensor([[0, 3, 10, 5]])
    out = token_logprobs(logits, targets, 1.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _manual_logprobs(logits.float(), targets, [1.0]))


# ---------------------------------------------------------------- rows the trainer leaves out of the gradient pass


def test_gradient_rows_and_policy_width() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.5, 0.0], [0.2, 0.2, 0.2]])
    assert gradient_rows(rewards, has_kl=False).tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert gradient_rows(rewards, has_kl=True).all()
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0, 0.0]])
    assert policy_width(mask) == 4
    assert policy_width(torch.zeros(2, 5)) == 5


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo"])
def test_leaving_out_zero_advantage_rows_keeps_the_gradient(advantage: str) -> None:
    """The trainer's shortcut: rows of constant-reward groups, trimmed to the policy width, with the whole batch's
    denominator, give the same parameter gradient as the full padded batch."""
    torch.manual_seed(0)
    model = CausalLM(ModelArgs(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                               intermediate_size=64, max_position_embeddings=64))
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.3, 0.3]])
    advantages = group_advantages(rewards, advantage).flatten()  # type: ignore[arg-type]
    input_ids = torch.randint(1, 16, (6, 9))
    targets = torch.randint(1, 16, (6, 9))
    mask = torch.zeros(6, 9)
    mask[:, 3:6] = 1.0
    mask[0, 3:9] = 1.0  # the longest row has zero advantage, so the trimmed pass is narrower
    jitter = torch.randn(6, 9) * 0.05  # mu a little off pi_prox, so the behaviour weight is not 1
    cfg = _cfg(advantage=advantage)
    denominator = float(6 * 8) if advantage == "dr_grpo" else float(mask.sum())  # Dr.GRPO: batch x max_new_tokens

    def grads(rows: torch.Tensor, width: int) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(model(input_ids[rows, :width]), targets[rows, :width], 1.0)
        behavior = logp.detach() + jitter[rows, :width]
        loss, _ = ppo_loss(logp, logp.detach(), behavior, advantages[rows], mask[rows, :width], cfg,
                           correction=PrecisionConfig(), denominator=denominator)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    keep = gradient_rows(rewards, has_kl=False).nonzero().squeeze(-1)
    assert keep.tolist() == [2, 3]
    full = grads(torch.arange(6), 9)
    part = grads(keep, policy_width(mask[keep]))
    assert policy_width(mask[keep]) == 6
    assert any(g.abs().max() > 1e-4 for g in full)
    for g_full, g_part in zip(full, part, strict=True):
        torch.testing.assert_close(g_part, g_full, rtol=1e-5, atol=1e-7)
