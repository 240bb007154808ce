"""Training-inference mismatch (Jet-RL's diagnostics): per token, delta = logp_trainer - logp_rollout at the same
weight version, so any nonzero delta is numerics, not staleness (`scorable_versions` says which version that is).

  abs_mean, abs_max     mean and max |delta|
  k3                    mean(e^delta - 1 - delta): estimates KL(rollout || trainer) on rollout samples
  exp_abs_mean          exp(mean |delta|)
  seq_delta_abs_mean    mean over sequences of |sum of delta| (the log of the sequence's IS weight)
  tis_clip_frac         tokens whose TIS weight e^delta exceeds the cap C
Bucketed by position too: `abs_mean@128-255` covers the logits at positions 128..255 of their sequences.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


def scorable_versions(mask: torch.Tensor, v_tok: torch.Tensor, kept_kv: bool) -> torch.Tensor:
    """Per token of `mask` (bool [B, T]), the one version whose full forward pass reproduces the log-prob rollout
    recorded for it, or -1 where none does. With caches recomputed on a swap that is the token's own version. With
    kept caches a token after a swap attended to keys an older version wrote, so only each row's first-version
    segment has one: from its first policy token (whose forward also wrote the prompt's keys) up to the first token,
    policy or not, of another version."""
    if not kept_kv:
        return torch.where(mask, v_tok, -1)
    completion = mask.cumsum(1) > 0
    first = v_tok.gather(1, completion.int().argmax(1, keepdim=True)).expand_as(v_tok)
    segment = (completion & (v_tok != first)).cumsum(1) == 0
    return torch.where(mask & segment, first, -1)


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


class Growth(NamedTuple):
    ratio: float  # latest / max(baseline, floor)
    latest: float  # mean k3 of the latest measured steps
    baseline: float  # mean k3 of the first measured steps
    num_latest: int
    num_first: int


def k3_growth(k3s: list[float], window: int, floor: float) -> Growth | None:
    """k3's growth over training: the mean of the latest `window` measured steps over the mean of the first `window`
    (while fewer than 2 x window are measured, the first ones against the rest: at the second it is step 2 / step 1);
    None before the second measured step."""
    if len(k3s) < 2:
        return None
    first = min(window, len(k3s) - 1)
    baseline = sum(k3s[:first]) / first
    latest = k3s[max(first, len(k3s) - window):]
    mean = sum(latest) / len(latest)
    return Growth(mean / max(baseline, floor), mean, baseline, len(latest), first)
