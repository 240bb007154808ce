"""The loss of jetroll: GRPO advantages and decoupled PPO with behaviour correction.

Three policies appear per token (docs/architecture.md, "Staleness and versions"):
  mu      = behavior_logp, the rollout policy that sampled the token (possibly stale weights);
  pi_prox = prox_logp, the trainer's own log-probs at the start of the step (no grad);
  pi_theta = logp, the policy being optimised (has grad).
The PPO ratio is taken against pi_prox; the gap between pi_prox and mu is corrected by a capped,
stop-gradient importance weight, and tokens whose pi_prox/mu leaves a trusted band are masked.
"""

from __future__ import annotations

from typing import Literal

import torch

from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.config.trainer import TrainerConfig
from jetroll.shared.model import exact
from jetroll.shared.rl.ranks import ONE_RANK, Ranks


def group_advantages(rewards: torch.Tensor, kind: Literal["grpo", "dr_grpo"] = "grpo") -> torch.Tensor:
    """Per-group advantages for rewards of shape [num_groups, group_size].

    GRPO: (r - mean) / (std + 1e-6), with the population std of the group.
    Dr.GRPO: r - mean (no std). A group with constant reward gets all-zero advantages.
    """
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if kind == "dr_grpo":
        return centered
    if kind == "grpo":
        return centered / (rewards.std(dim=-1, unbiased=False, keepdim=True) + 1e-6)
    raise ValueError(f"unknown advantage kind {kind!r}")


def k3(delta: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator exp(d) - 1 - d, with d = log q - log p on samples of p; always >= 0."""
    return torch.expm1(delta) - delta


def behavior_correction(
    prox_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor, correction: PrecisionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stop-gradient weight w and the 0/1 keep mask per token [B, T] for r = pi_prox / mu, by
    `precision.correction` (its cap C and bands are `precision` fields too)."""
    log_ratio = prox_logp - behavior_logp
    ratio = torch.exp(log_ratio)
    cap = correction.correction_cap
    if correction.correction == "decoupled":
        low, high = correction.decoupled_band
        return ratio.clamp(max=cap), ((ratio >= low) & (ratio <= high)).float()
    if correction.correction == "none":
        return torch.ones_like(ratio), torch.ones_like(ratio)
    if correction.correction == "token_tis":
        return ratio.clamp(max=cap), torch.ones_like(ratio)
    if correction.correction == "icepop":
        low, high = correction.icepop_band
        return ratio, ((ratio >= low) & (ratio <= high)).float()
    assert correction.correction == "seq_mis"
    seq_ratio = torch.exp(torch.where(mask > 0, log_ratio, 0.0).sum(-1, keepdim=True)).expand_as(ratio)
    return seq_ratio, (seq_ratio <= cap).float()


def loss_denominator(advantage: str, loss_mask: torch.Tensor, sample_budgets: list[int],
                     ranks: Ranks = ONE_RANK) -> float:
    """What the summed token loss is divided by. Dr.GRPO: its constant, batch x max_new_tokens (each sample's
    generation budget), since a padded width would scale the step by the longest sample. Otherwise the batch's policy
    tokens, rows without a gradient included. Sharded, the whole step's, summed over the ranks' shares: the
    gradients are summed too, so the update does not depend on the split."""
    if advantage == "dr_grpo":
        return ranks.reduce([float(sum(sample_budgets))])[0]
    return max(ranks.reduce([float(loss_mask.sum())])[0], 1.0)


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: TrainerConfig,
    *,
    correction: PrecisionConfig,
    denominator: float | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss over token tensors [B, T]; returns (scalar loss, float stats).

    `advantages` is [B] (one per sequence, broadcast over tokens) or [B, T]. The summed token loss
    is divided by the number of loss_mask == 1 tokens counted before band masking, or by `denominator` when given:
    Dr.GRPO's constant (batch x max_new_tokens), or the token count of a batch some rows of which were left out.
    `correction` picks the behaviour correction (`behavior_correction`): required, so a caller cannot drop the job's
    `precision` section and train with the defaults' correction unseen.
    `entropy` [B, T], pi_theta's token entropy with grad, adds the bonus -cfg.entropy_coef x entropy per token.
    One function of 80 lines, on purpose: the stats read ten of the loss's intermediates, which a split would pass.
    """
    mask = loss_mask.float()
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(logp)
    num_tokens = mask.sum()
    denom = float(denominator) if denominator is not None else num_tokens.clamp(min=1.0)
    prox_logp = prox_logp.detach()
    behavior_logp = behavior_logp.detach()

    # PPO ratio against pi_prox, clipped asymmetrically; pessimistic min of the two surrogates.
    ratio = torch.exp(logp - prox_logp)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    # Dual clip: for A < 0 the objective is floored at c * A, so the loss never exceeds -c * A.
    dual = torch.maximum(surrogate, cfg.dual_clip_c * adv)
    objective = torch.where(adv < 0, dual, surrogate)

    # Behaviour correction: by default w = sg(min(pi_prox / mu, C)), tokens whose pi_prox / mu leaves the band masked.
    behavior_ratio = torch.exp(prox_logp - behavior_logp)
    weight, in_band = behavior_correction(prox_logp, behavior_logp, mask, correction)
    keep = mask * in_band

    token_loss = -weight * objective
    if cfg.kl_coef > 0 and ref_logp is not None:
        kl_ref = k3(ref_logp.detach() - logp)  # k3 estimate of KL(pi_theta || pi_ref)
        token_loss = token_loss + cfg.kl_coef * kl_ref
    if cfg.entropy_coef > 0 and entropy is not None:
        token_loss = token_loss - cfg.entropy_coef * entropy
    loss = torch.where(keep > 0, token_loss, 0.0).sum() / denom  # where, not *: padding may hold inf

    # Stats, all over loss_mask tokens (the band statistics are what band masking removed).
    with torch.no_grad():
        n = num_tokens.clamp(min=1.0)

        def mean(x: torch.Tensor, m: torch.Tensor = mask) -> float:
            return float(torch.where(m > 0, x.float(), 0.0).sum() / m.sum().clamp(min=1.0))

        clipped = (clipped_ratio * adv < ratio * adv).float()  # clipped side of the min was active
        dual_clipped = ((adv < 0) & (cfg.dual_clip_c * adv > surrogate)).float()
        any_token = mask > 0
        stats = {
            "loss": float(loss.detach()),
            "clip_frac": mean(clipped),
            "dual_clip_frac": mean(dual_clipped),
            "is_weight_mean": mean(weight),
            "is_weight_max": float(weight[any_token].max()) if any_token.any() else 0.0,
            "is_ratio_max": float(behavior_ratio[any_token].max()) if any_token.any() else 0.0,
            "is_capped_frac": mean((behavior_ratio > correction.correction_cap).float()),
            "band_masked_frac": float((mask * (1.0 - in_band)).sum() / n),
            "band_masked_tokens": float((mask * (1.0 - in_band)).sum()),
            "policy_lag_k3": mean(k3(behavior_logp - prox_logp)),  # KL(pi_prox || mu) estimate
            "approx_kl": mean(k3(prox_logp - logp.detach())),  # KL(pi_theta || pi_prox) estimate
            "num_tokens": float(num_tokens),
        }
        if cfg.kl_coef > 0 and ref_logp is not None:
            stats["kl_ref"] = mean(k3(ref_logp.detach() - logp.detach()))
    return loss, stats


def _scaled(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """logits / T in fp32; `temperature` is a float or a per-sequence tensor [B]."""
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=logits.device, dtype=torch.float32).reshape(-1, 1, 1)
    return logits / temperature


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor, is_exact: bool = False
) -> torch.Tensor:
    """log_softmax(logits / T) at `targets`, in fp32: [B, T, V], [B, T] -> [B, T].

    `temperature` is a float or a per-sequence tensor [B] (the temperature recorded on each trajectory).
    `is_exact` takes the exact backend's batch-invariant log_softmax, the one the rollout engine records with.
    """
    scaled = _scaled(logits, temperature)
    logprobs = exact.log_softmax(scaled) if is_exact else torch.log_softmax(scaled, dim=-1)
    return logprobs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits / T) at each position, in fp32: [B, T, V] -> [B, T]. Differentiable
    (the entropy bonus); callers that only report it run it under no_grad."""
    logprobs = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    finite = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)  # p = 0 adds 0, and a zero grad rather than nan
    return -(finite.exp() * finite).sum(-1)
