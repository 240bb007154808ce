"""Training-inference mismatch (Jet-RL's diagnostics): per token, delta = logp_trainer - logp_rollout at the same
weight version, so any nonzero delta is numerics, not staleness.

  abs_mean, abs_max     mean and max |delta|
  k3                    mean(e^delta - 1 - delta): estimates KL(rollout || trainer) on rollout samples
  exp_abs_mean          exp(mean |delta|)
  seq_delta_abs_mean    mean over sequences of |sum of delta| (the log of the sequence's IS weight)
  tis_clip_frac         tokens whose TIS weight e^delta exceeds the cap C
Bucketed by position too: `abs_mean@128-255` covers the logits at positions 128..255 of their sequences.
"""

from __future__ import annotations

import math

import torch

POSITION_EDGES = (0, 128, 256, 512, 1024, 2048)


def _token_stats(delta: torch.Tensor, tis_cap: float) -> dict[str, float]:
    delta = delta.double()
    abs_mean = float(delta.abs().mean())
    return {
        "abs_mean": abs_mean,
        "abs_max": float(delta.abs().max()),
        "k3": float((torch.expm1(delta) - delta).mean()),
        "exp_abs_mean": math.exp(abs_mean),
        "tis_clip_frac": float((delta.exp() > tis_cap).double().mean()),
    }


def one_version_tokens(mask: torch.Tensor, v_tok: torch.Tensor, version: int, kept_kv: bool) -> torch.Tensor:
    """The tokens of `mask` whose log-prob rollout computed entirely at `version`: sampled at it and, when rollout kept
    its KV caches across swaps, with every earlier position of the completion computed at it too."""
    same = mask & (v_tok == version)
    if kept_kv:
        completion = mask.cumsum(1) > 0  # from the first policy token on; prompt keys come from that token's forward
        same &= (completion & (v_tok != version)).cumsum(1) == 0
    return same


def mismatch_stats(
    trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, tis_cap: float = 2.0,
    prefix: str = "mismatch/",
) -> dict[str, float]:
    """Mismatch over the tokens of `mask` (bool [B, T]; column = position in the sequence); empty without tokens."""
    if not mask.any():
        return {}
    delta = torch.where(mask, trainer_logp.double() - rollout_logp.double(), 0.0)
    stats = _token_stats(delta[mask], tis_cap)
    stats["seq_delta_abs_mean"] = float(delta.sum(1)[mask.any(1)].abs().mean())
    stats["tokens"] = float(mask.sum())
    bounds = [*POSITION_EDGES, None]
    for low, high in zip(bounds[:-1], bounds[1:], strict=True):
        bucket = mask[:, low:high]
        if not bucket.any():
            continue
        values = delta[:, low:high][bucket]
        name = f"{low}-{high - 1}" if high is not None else f"{low}+"
        stats[f"abs_mean@{name}"] = float(values.abs().mean())
        stats[f"abs_max@{name}"] = float(values.abs().max())
        stats[f"k3@{name}"] = float((torch.expm1(values) - values).mean())
        stats[f"tokens@{name}"] = float(bucket.sum())
    return {prefix + key: value for key, value in stats.items()}
