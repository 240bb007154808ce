"""The trainer's forward passes over one batch: which rows need a gradient, packing, and the exact backend's pi_prox.

`policy_pass` gives the step what the algorithm needs, whatever the backend: the log-probs of the gradient rows (with
grad) and, for the entropy bonus, their token entropy with grad, and pi_prox with its token entropy for the rows it
scores (the gradient rows, or every row: on the exact backend, or when asked).
Every pass maps hidden states to log-probs through `head_logprobs`, a chunk of tokens at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.precision import use_exact
from jetroll.shared.rl.batch import TokenBatch, pack_groups, packed_length
from jetroll.shared.rl.loss import token_entropy, token_logprobs
from jetroll.shared.rl.ranks import ONE_RANK, Ranks

LOGIT_CHUNK_ELEMENTS = 1 << 23  # fp32 logits of one chunk of tokens: 32 MB, whatever the vocabulary


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
        return head_logprobs(model, model.hidden(input_ids), targets, temperature)


def group_hidden(model: CausalLM, batch: TokenBatch, rows: torch.Tensor, width: int, pad_id: int,
                 ranks: Ranks = ONE_RANK) -> torch.Tensor:
    """Hidden states [n, width, H] of `rows` (whole groups) in the row layout. Groups go forward in buckets of similar
    length, since a multi-task batch mixes 30-token sums with 200-token episodes and one padded width would cost the
    short ones several times their tokens; a bucket is packed behind its groups' shared prompts where that is the
    cheaper forward. Positions past a bucket's longest row are zeros: padding, outside every loss.
    Sharded, a rank runs as many forwards as the rank with the most buckets: its extra ones are of one pad token,
    added in at weight 0, so that a backward reaches each of them too (`rows` may then be empty)."""
    group_size = batch.rewards.shape[1]
    input_ids, lengths = batch.input_ids[rows], batch.lengths[rows]
    group_lengths = lengths.view(-1, group_size).amax(dim=1).clamp(max=width)
    parts, order = [], []
    buckets = length_buckets(group_lengths)
    # agreed before any forward: a collective between two ranks' all-gathers would pair with the wrong one
    extra = ranks.most(len(buckets)) - len(buckets)
    for groups in buckets:
        bucket_rows = (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).flatten()
        bucket_width = int(group_lengths[groups].max())
        hidden = bucket_hidden(model, input_ids[bucket_rows], lengths[bucket_rows], group_size, bucket_width, pad_id)
        parts.append(F.pad(hidden, (0, 0, 0, width - bucket_width)))
        order.append(bucket_rows)
    hidden = (torch.cat(parts)[torch.argsort(torch.cat(order))] if parts
              else torch.zeros(0, width, model.args.hidden_size, device=input_ids.device))
    if not extra:
        return hidden
    pad = torch.full((1, 1), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    return hidden + sum(model.hidden(pad).sum() for _ in range(extra)) * 0.0


def length_buckets(group_lengths: torch.Tensor) -> list[torch.Tensor]:
    """Group indices in buckets by length, shortest first: a bucket takes groups up to twice its shortest's length,
    so padding at most doubles a group's tokens and a batch needs a few forwards, not one per length."""
    order = torch.argsort(group_lengths)
    buckets, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or group_lengths[order[i]] > 2 * group_lengths[order[start]]:
            buckets.append(order[start:i])
            start = i
    return buckets


def bucket_hidden(model: CausalLM, input_ids: torch.Tensor, lengths: torch.Tensor, group_size: int, width: int,
                  pad_id: int) -> torch.Tensor:
    """Hidden states [n, width, H] of whole groups, packed by group where that costs fewer multiply-adds: short
    answers behind a shared prompt pack to about half the tokens, long multi-turn samples packed make one long
    sequence whose attention costs more than the prompt saves."""
    # the exact backend runs causal attention only: its no-grad passes (the KL reference's) take the row layout
    if use_exact(model.precision) or not is_packing_cheaper(model, input_ids, lengths, group_size, width):
        return model.hidden(input_ids[:, :width])
    packed = pack_groups(input_ids, lengths, group_size, pad_id)
    hidden = model.hidden(packed.input_ids, packed.positions, attn_mask=packed.attn_mask)
    return hidden.flatten(0, 1)[packed.index[:, :width]]


def is_packing_cheaper(model: CausalLM, input_ids: torch.Tensor, lengths: torch.Tensor, group_size: int,
                       width: int) -> bool:
    """Whether a forward of the rows [n, W] packed by group costs fewer multiply-adds than one of their first `width`
    columns."""
    packed = forward_cost(model, len(input_ids) // group_size, packed_length(input_ids, lengths, group_size))
    return packed < forward_cost(model, len(input_ids), width)


def forward_cost(model: CausalLM, num_sequences: int, seq_len: int) -> int:
    """Multiply-adds of a forward over [num_sequences, seq_len] per layer: the projections and MLP per token, and
    attention over every key (a packed mask hides keys but SDPA still computes them)."""
    args = model.args
    attention_width = args.num_heads * args.head_dim
    per_token = args.hidden_size * (2 * attention_width + 2 * args.num_kv_heads * args.head_dim) \
        + 3 * args.hidden_size * args.intermediate_size
    return num_sequences * seq_len * (per_token + 2 * seq_len * attention_width)


def head_logprobs(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor,
                  temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T) at `targets` and the token entropy [n, T], from hidden states [n, T, H] and a
    temperature per row [n], a chunk of tokens at a time: at a real vocabulary the logits are the largest activation
    (8 x 512 tokens x 151,936 ids are 2.5 GB in fp32), so [n, T, V] never exists whole. Under grad, backward
    recomputes each chunk's logits and adds lm_head's gradient into one buffer."""
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    flat_temperature = temperature.float().reshape(-1, 1).expand(shape).reshape(-1)
    weight = model.lm_head.weight
    if torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad):
        logp, entropy = _ChunkedHead.apply(flat, weight, flat_targets, flat_temperature, model)
    else:
        logp, entropy = _chunked_stats(model.logits, flat, flat_targets, flat_temperature, weight.shape[0],
                                       use_exact(model.precision))
    return logp.view(shape), entropy.view(shape)


def _chunked_stats(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                   temperature: torch.Tensor, vocab: int, is_exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs at `targets` and token entropies [N] of flat hidden states [N, H], one chunk's logits at a time."""
    logp, entropy = (torch.empty(len(targets), device=hidden.device) for _ in range(2))
    for chunk in _chunks(len(targets), vocab):
        logits = logits_of(hidden[chunk])[:, None]
        logp[chunk] = token_logprobs(logits, targets[chunk, None], temperature[chunk], is_exact)[:, 0]
        entropy[chunk] = token_entropy(logits, temperature[chunk])[:, 0]
    return logp, entropy


def _chunks(num_tokens: int, vocab: int) -> list[slice]:
    size = max(1, LOGIT_CHUNK_ELEMENTS // vocab)
    return [slice(start, start + size) for start in range(0, num_tokens, size)]


class _ChunkedHead(torch.autograd.Function):
    """`head_logprobs` with grad: forward keeps no logits, backward recomputes them a chunk at a time. The gradient
    is the analytic one of log_softmax: d log p_y / ds = onehot(y) - p and dH / ds = -p (log p + H), for s = z / T."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                temperature: torch.Tensor, model: CausalLM) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.model = model
        ctx.set_materialize_grads(False)
        # never the exact backend: this is a grad pass, though autograd runs its forward without grad
        logp, entropy = _chunked_stats(lambda h: _fast_logits(model, h, weight), hidden, targets, temperature,
                                       weight.shape[0])
        ctx.save_for_backward(hidden, weight, targets, temperature, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, temperature, entropy = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, device=weight.device)  # fp32 whatever the weight
                       if ctx.needs_input_grad[1] else None)
        for chunk in _chunks(len(targets), weight.shape[0]):
            scaled = _fast_logits(ctx.model, hidden[chunk], weight).div_(temperature[chunk, None])
            log_probs = torch.log_softmax(scaled, dim=-1)
            del scaled
            grad = log_probs.exp()  # p; becomes d loss / d s in place
            if grad_entropy is not None:  # log_probs becomes p (log p + H) in place; ids at -inf have p = 0
                spread = log_probs.clamp_(min=torch.finfo(log_probs.dtype).min).add_(entropy[chunk, None]).mul_(grad)
            if grad_logp is not None:
                grad.mul_(-grad_logp[chunk, None])
                grad[torch.arange(len(grad), device=grad.device), targets[chunk]] += grad_logp[chunk]
            else:
                grad.zero_()
            if grad_entropy is not None:
                grad.addcmul_(spread, grad_entropy[chunk, None], value=-1.0)
            del log_probs
            grad.div_(temperature[chunk, None])
            if grad_hidden is not None:
                grad_hidden[chunk] = grad.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, hidden[chunk].float())
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _fast_logits(model: CausalLM, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return model.mask_no_string(F.linear(hidden, weight).float())


@dataclass(frozen=True, slots=True)
class PolicyPass:
    rows: torch.Tensor  # indices of the gradient rows
    width: int  # their columns up to the last policy token
    logp: torch.Tensor | None  # [rows, width] with grad; None when no row has a gradient
    row_entropy: torch.Tensor | None  # [rows, width] their token entropy with grad; None unless asked for
    prox_logp: torch.Tensor  # [B, T] pi_prox: the weights at the start of the step, on the scored rows
    entropy: torch.Tensor  # [B, T] its token entropy, on the scored rows
    scored: torch.Tensor  # [B] bool: the rows prox_logp and entropy hold


def policy_pass(model: CausalLM, batch: TokenBatch, with_grad: torch.Tensor, pad_id: int, *,
                entropy_grad: bool = False, score_all: bool = False, ranks: Ranks = ONE_RANK) -> PolicyPass:
    """The forward passes of one step. `with_grad` [B] marks the rows of the gradient pass; `entropy_grad` also gives
    their entropy with grad (the entropy bonus). On `fast`, pi_prox is the gradient pass's own forward, detached (one
    update per version); the other rows get a no-grad pass only with `score_all` (for the metrics: zero advantage
    leaves them out of the loss, and that pass was a fifth of an async step). On `exact` pi_prox comes from a full
    exact pass over every row, and the gradient pass stays on `fast`. Sharded, a pass runs on every rank when it runs
    on any (`group_hidden`): a rank whose share has no gradient row still runs the gradient pass, on no rows."""
    is_exact = model.precision.backend == "exact"
    if is_exact:
        prox_logp, entropy = proximal_pass(model, batch.input_ids, batch.targets, batch.temperature)
        model.release_inference_weights()
    else:  # filled from the passes below
        prox_logp, entropy = torch.zeros_like(batch.behavior_logp), torch.zeros_like(batch.behavior_logp)
    # a step with no gradient row has no backward either: its metrics may as well cover every row
    scored = torch.ones_like(with_grad) if is_exact or score_all or not with_grad.any() else with_grad.clone()
    idle = (scored & ~with_grad).nonzero().squeeze(-1)
    if not is_exact and ranks.most(len(idle)):
        width = policy_width(batch.loss_mask[idle])
        with torch.no_grad():
            hidden = group_hidden(model, batch, idle, width, pad_id, ranks)
            prox_logp[idle, :width], entropy[idle, :width] = head_logprobs(
                model, hidden, batch.targets[idle, :width], batch.temperature[idle])
        model.release_inference_weights()  # this version is used once; the grad pass and backward need the room
    rows = with_grad.nonzero().squeeze(-1)
    if not ranks.most(len(rows)):
        return PolicyPass(rows, 0, None, None, prox_logp, entropy, scored)
    width = policy_width(batch.loss_mask[rows])
    logp, row_entropy = gradient_logp(model, batch, rows, width, pad_id, ranks)
    if not is_exact:
        prox_logp[rows, :width] = logp.detach()
        entropy[rows, :width] = row_entropy.detach()
    return PolicyPass(rows, width, logp, row_entropy if entropy_grad else None, prox_logp, entropy, scored)


def gradient_logp(model: CausalLM, batch: TokenBatch, rows: torch.Tensor, width: int, pad_id: int,
                  ranks: Ranks = ONE_RANK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient pass: log-probs and token entropy [rows, width] of `rows` (whole groups), with grad."""
    hidden = group_hidden(model, batch, rows, width, pad_id, ranks)
    return head_logprobs(model, hidden, batch.targets[rows, :width], batch.temperature[rows])


def reference_logp(reference: CausalLM, batch: TokenBatch, rows: torch.Tensor, width: int, pad_id: int,
                   ranks: Ranks = ONE_RANK) -> torch.Tensor:
    """The reference policy's log-probs [rows, width], for the KL term."""
    with torch.no_grad():
        hidden = group_hidden(reference, batch, rows, width, pad_id, ranks)
        logp = head_logprobs(reference, hidden, batch.targets[rows, :width], batch.temperature[rows])[0]
    # rebuilt next step: rounding a frozen model costs far less than its forward, and the backward needs the room
    reference.release_inference_weights()
    return logp
