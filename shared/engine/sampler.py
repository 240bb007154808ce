"""Sampling: mu (the log-softmax at each request's temperature) and the token each request draws from it.

Counter-based: token i of a request is drawn from the uniform number i of a stream keyed by its `sampling_key`, so a
sample depends on its seed, its id and the logits it saw, never on the requests decoded beside it."""

from __future__ import annotations

import numpy as np
import torch

from jetroll.shared.engine.request import Request
from jetroll.shared.model import exact
from jetroll.shared.seeds import uniforms


def token_logprobs(batch: list[Request], logits: torch.Tensor, is_exact: bool) -> torch.Tensor:
    """mu [B, V]: log-softmax(logits / T) per request (T 0, greedy, keeps the logits as they are)."""
    if any(r.temperature not in (0.0, 1.0) for r in batch):
        scale = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in batch], device=logits.device)
        logits = logits / scale[:, None]
    return exact.log_softmax(logits) if is_exact else torch.log_softmax(logits, dim=-1)


def choose_tokens(batch: list[Request], logprobs: torch.Tensor) -> torch.Tensor:
    """Each request's next token [B]: greedy at T 0, else drawn from its stream within its top-p mass."""
    device = logprobs.device
    probs = logprobs.exp()
    if any(r.top_p < 1 for r in batch):
        top_p = torch.tensor([r.top_p for r in batch], device=device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    keys = np.array([r.sampling_key for r in batch], dtype=np.uint64)
    counters = np.array([len(r.output_ids) for r in batch], dtype=np.uint64)
    sampled = sample_tokens(probs, torch.from_numpy(uniforms(keys, counters)).to(device))
    if not any(r.temperature == 0 for r in batch):
        return sampled
    greedy = torch.tensor([r.temperature == 0 for r in batch], device=device)
    return torch.where(greedy, logprobs.argmax(-1), sampled)


def sample_tokens(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row of `probs` [B, V] (unnormalised, >= 0), the first token whose cumulative mass
    exceeds `uniform` [B] (fp64 in [0, 1)) times the row's total. A row's token depends on that row alone."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    target = (uniform * cdf[:, -1])[:, None]
    # right=True skips zero-probability tokens; the clamp catches a target that rounds up to the total
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)
