"""The trainer's forward passes over one batch: which rows need a gradient, packing, and the exact backend's pi_prox.

`policy_pass` gives the step what the algorithm needs, whatever the backend: the log-probs of the gradient rows (with
grad) and, for the entropy bonus, their token entropy with grad, and pi_prox with its token entropy for every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetroll.shared.model.model import CausalLM
from jetroll.shared.rl.batch import TokenBatch, pack_groups
from jetroll.shared.rl.loss import token_entropy, token_logprobs


def gradient_rows(rewards: torch.Tensor, has_kl: bool) -> torch.Tensor:
    """Which sequences of a [num_groups, group_size] reward batch need the gradient pass, as a flat bool [B]: those
    of groups whose rewards differ (the rest have zero advantage in GRPO and Dr.GRPO), or all under a KL term."""
    varies = rewards.amax(dim=-1) > rewards.amin(dim=-1)
    if has_kl:
        varies = torch.ones_like(varies)
    return varies.repeat_interleave(rewards.shape[-1])


def policy_width(loss_mask: torch.Tensor) -> int:
    """Columns up to the last policy token of any row: a causal model's log-probs there do not see the padding after."""
    columns = loss_mask.sum(dim=0).nonzero()
    return int(columns.max()) + 1 if len(columns) else loss_mask.shape[1]


def proximal_pass(
    model: CausalLM, input_ids: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's no-grad pass: log-probs and token entropies [B, T]. On the exact backend the log-probs are bitwise
    what rollout recorded at this version, whatever the batch composition and padding."""
    with torch.no_grad():
        logits = model(input_ids)
        is_exact = model.precision.backend == "exact"
        return token_logprobs(logits, targets, temperature, is_exact=is_exact), token_entropy(logits, temperature)


def group_logits(model: CausalLM, batch: TokenBatch, rows: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    """Logits [n, width, V] of `rows` (whole groups) in the row layout, from one forward of each group packed behind
    its shared prompt: about half the tokens of the padded rows for short answers."""
    packed = pack_groups(batch.input_ids[rows], batch.lengths[rows], batch.rewards.shape[1], pad_id)
    logits = model(packed.input_ids, packed.positions, attn_mask=packed.attn_mask)
    return logits.flatten(0, 1)[packed.index[:, :width]]


@dataclass(frozen=True, slots=True)
class PolicyPass:
    rows: torch.Tensor  # indices of the gradient rows
    width: int  # their columns up to the last policy token
    logp: torch.Tensor | None  # [rows, width] with grad; None when no row has a gradient
    row_entropy: torch.Tensor | None  # [rows, width] their token entropy with grad; None unless asked for
    prox_logp: torch.Tensor  # [B, T] pi_prox: the weights at the start of the step
    entropy: torch.Tensor  # [B, T] its token entropy


def policy_pass(model: CausalLM, batch: TokenBatch, with_grad: torch.Tensor, pad_id: int, *,
                entropy_grad: bool = False) -> PolicyPass:
    """The forward passes of one step. `with_grad` [B] marks the rows of the gradient pass; the rest get a no-grad
    pass only; `entropy_grad` also gives the gradient rows' entropy with grad (the entropy bonus). On `fast`,
    pi_prox is the gradient pass's own forward, detached (one update per version); on `exact` it comes from a full
    exact pass, and the gradient pass stays on `fast`."""
    is_exact = model.precision.backend == "exact"
    if is_exact:
        prox_logp, entropy = proximal_pass(model, batch.input_ids, batch.targets, batch.temperature)
    else:  # filled from the passes below: every row gets one
        prox_logp, entropy = torch.zeros_like(batch.behavior_logp), torch.zeros_like(batch.behavior_logp)
    idle = (~with_grad).nonzero().squeeze(-1)
    if not is_exact and len(idle):
        width = policy_width(batch.loss_mask[idle])
        with torch.no_grad():
            logits = group_logits(model, batch, idle, width, pad_id)
            prox_logp[idle, :width] = token_logprobs(logits, batch.targets[idle, :width], batch.temperature[idle])
            entropy[idle, :width] = token_entropy(logits, batch.temperature[idle])
    rows = with_grad.nonzero().squeeze(-1)
    if not len(rows):
        return PolicyPass(rows, 0, None, None, prox_logp, entropy)
    width = policy_width(batch.loss_mask[rows])
    logits = group_logits(model, batch, rows, width, pad_id)
    logp = token_logprobs(logits, batch.targets[rows, :width], batch.temperature[rows])
    row_entropy = None
    if entropy_grad or not is_exact:
        with torch.set_grad_enabled(entropy_grad):  # the metric alone needs no graph
            row_entropy = token_entropy(logits, batch.temperature[rows])
    if not is_exact:
        prox_logp[rows, :width] = logp.detach()
        entropy[rows, :width] = row_entropy.detach()
    return PolicyPass(rows, width, logp, row_entropy if entropy_grad else None, prox_logp, entropy)


def reference_logp(reference: CausalLM, batch: TokenBatch, rows: torch.Tensor, width: int,
                   pad_id: int) -> torch.Tensor:
    """The reference policy's log-probs [rows, width], for the KL term."""
    with torch.no_grad():
        logits = group_logits(reference, batch, rows, width, pad_id)
        return token_logprobs(logits, batch.targets[rows, :width], batch.temperature[rows])
