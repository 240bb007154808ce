"""The trainer's packed forward: each group's shared prompt once, then each sample's tail, gives the row layout's
logits and gradients."""

from __future__ import annotations

import pytest
import torch

from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.config.trainer import TrainerConfig
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.model import CausalLM
from jetroll.shared.numerics import Numerics
from jetroll.shared.rl.batch import TokenBatch, pack_groups, packed_length
from jetroll.shared.rl.loss import ppo_loss, token_logprobs
from jetroll.shared.rl.passes import group_hidden, is_packing_cheaper, length_buckets

PAD = 0


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Three groups of three right-padded rows: a short prompt, a long prompt whose samples also share their first
    answer token, and a group with two identical samples and one that is a prefix of the others."""
    group_rows = [
        [[5, 6, 7, 3], [5, 6, 7, 4, 9, 9], [5, 6, 7, 8, 2]],
        [[5, 9, 9, 9, 6, 7, 2, 3, 4], [5, 9, 9, 9, 6, 7, 2, 8], [5, 9, 9, 9, 6, 7, 2, 3, 11, 12, 13]],
        [[4, 4, 8, 10, 3], [4, 4, 8, 10, 3], [4, 4, 8]],
    ]
    rows = [r for group in group_rows for r in group]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
    return input_ids, torch.tensor([len(r) for r in rows])


def _model(mode: str) -> CausalLM:
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=16, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                     intermediate_size=256, max_position_embeddings=64)
    return CausalLM(args, Numerics(mode=mode))


def test_pack_groups_shares_each_groups_common_prefix() -> None:
    input_ids, lengths = _rows()
    packed = pack_groups(input_ids, lengths, group_size=3, pad_id=PAD)
    # group 0: prefix 3 + tails 1, 3, 2; group 1: prefix 7 + tails 2, 1, 4; group 2: prefix 3 + tails 2, 2, 0
    assert packed.input_ids.shape == (3, 14)
    assert packed.input_ids[0, :9].tolist() == [5, 6, 7, 3, 4, 9, 9, 8, 2]
    assert packed.positions[0, :9].tolist() == [0, 1, 2, 3, 3, 4, 5, 3, 4]
    assert packed.input_ids[2, :7].tolist() == [4, 4, 8, 10, 3, 10, 3]
    # a tail sees the prefix and its own earlier tokens, never another tail; the prefix never sees a tail
    mask = packed.attn_mask[0]
    assert mask[5].tolist()[:9] == [True, True, True, False, True, True, False, False, False]
    assert not mask[:3, 3:].any()
    # every real row position maps to the packed position holding the same token
    flat = packed.input_ids.flatten()
    for i in range(len(lengths)):
        assert flat[packed.index[i, : lengths[i]]].tolist() == input_ids[i, : lengths[i]].tolist()


def test_groups_are_packed_only_where_that_is_the_cheaper_forward() -> None:
    """Short answers behind a shared prompt pack (the arithmetic job); eight long multi-turn episodes behind a short
    prompt do not: one 8x-long sequence's attention costs more than the prompt's repeats."""
    model = _model("fp32")
    input_ids, lengths = _rows()
    assert packed_length(input_ids, lengths, 3) == pack_groups(input_ids, lengths, 3, PAD).input_ids.shape[1] == 14

    def group(prompt: int, answer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1, 16, (8, prompt + answer))
        ids[:, :prompt] = ids[0, :prompt]
        return ids, torch.full((8,), prompt + answer)

    assert is_packing_cheaper(model, *group(prompt=24, answer=6), group_size=8, width=30)
    assert not is_packing_cheaper(model, *group(prompt=40, answer=200), group_size=8, width=240)


def test_a_mixed_batch_goes_forward_in_length_buckets_and_gives_the_row_layouts_hidden_states_and_gradients() -> None:
    """Sums, tool calls and long episodes in one batch: each bucket in its cheaper layout, the result the rows'."""
    model = _model("fp32")
    torch.manual_seed(1)
    spec = [(6, 2), (40, 1), (5, 45), (6, 3), (8, 10)]  # (prompt, answer) per group of 4, in batch order
    rows, lengths = [], []
    for prompt, answer in spec:
        shared = torch.randint(1, 16, (prompt,))
        for k in range(4):
            tail = answer - (k % 2)  # samples of a group differ in length
            rows.append(torch.cat([shared, torch.randint(1, 16, (tail,))]))
            lengths.append(prompt + tail)
    width = max(lengths)
    input_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
    lengths_t = torch.tensor(lengths)
    group_lengths = lengths_t.view(-1, 4).amax(dim=1)
    assert [b.tolist() for b in length_buckets(group_lengths)] == [[0, 3], [4], [1, 2]]  # 8, 9 | 18 | 41, 50
    def bucket_packs(groups: list[int]) -> bool:
        at = torch.tensor([g * 4 + k for g in groups for k in range(4)])
        return is_packing_cheaper(model, input_ids[at], lengths_t[at], 4, int(lengths_t[at].max()))

    assert bucket_packs([0, 3]) and not bucket_packs([1, 2])  # both layouts in one batch
    zeros = torch.zeros(len(rows), width)
    batch = TokenBatch(input_ids, input_ids, zeros, zeros, zeros, torch.ones(len(rows)), lengths_t,
                       torch.zeros(len(spec), 4), ["t"] * len(rows), ["p"] * len(rows), [""] * len(rows),
                       [False] * len(rows))
    is_real = torch.arange(width)[None, :] < lengths_t[:, None]
    weights = torch.randn(len(rows), width, 128)

    def run(forward: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        hidden = forward()  # type: ignore[operator]
        (hidden * weights)[is_real].sum().backward()
        return hidden.detach(), [p.grad.clone() for p in model.parameters()]

    by_buckets, grads = run(lambda: group_hidden(model, batch, torch.arange(len(rows)), width, PAD))
    by_rows, row_grads = run(lambda: model.hidden(input_ids))
    torch.testing.assert_close(by_buckets[is_real], by_rows[is_real], rtol=1e-5, atol=1e-5)
    assert not by_buckets[~is_real & (torch.arange(width)[None, :] >= 9)][:4].any()  # a short bucket's padding
    for g_buckets, g_rows in zip(grads, row_grads, strict=True):
        torch.testing.assert_close(g_buckets, g_rows, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp8_unified"])
def test_packed_forward_matches_the_row_layout(mode: str) -> None:
    model = _model(mode)
    input_ids, lengths = _rows()
    packed = pack_groups(input_ids, lengths, group_size=3, pad_id=PAD)
    is_real = torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        rows = model(input_ids)
        from_packed = model(packed.input_ids, packed.positions, attn_mask=packed.attn_mask).flatten(0, 1)[packed.index]
    assert rows.abs().max() > 0.1
    torch.testing.assert_close(from_packed[is_real], rows[is_real], rtol=1e-5, atol=1e-5)


def test_packed_gradient_matches_the_row_layout() -> None:
    model = _model("fp32")
    input_ids, lengths = _rows()
    targets = input_ids.roll(-1, dims=1)
    loss_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None] - 1).float()
    loss_mask[:, :2] = 0.0  # the prompt's first tokens are not policy tokens
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.2, -0.7, 0.5, 0.0, 1.0, -1.0])
    packed = pack_groups(input_ids, lengths, group_size=3, pad_id=PAD)

    def grads(logits_of: object) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(logits_of(), targets, 1.0)  # type: ignore[operator]
        loss, _ = ppo_loss(logp, logp.detach(), logp.detach() - 0.05, advantages, loss_mask, TrainerConfig(),
                           correction=PrecisionConfig())
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    by_rows = grads(lambda: model(input_ids))
    by_groups = grads(lambda: model(packed.input_ids, packed.positions,
                                    attn_mask=packed.attn_mask).flatten(0, 1)[packed.index])
    assert any(g.abs().max() > 1e-4 for g in by_rows)
    for g_rows, g_groups in zip(by_rows, by_groups, strict=True):
        torch.testing.assert_close(g_groups, g_rows, rtol=1e-4, atol=1e-6)


def test_exact_backend_refuses_an_attention_mask() -> None:
    model = CausalLM(_model("fp32").args, Numerics(mode="fp32", backend="exact"))
    input_ids, lengths = _rows()
    packed = pack_groups(input_ids, lengths, group_size=3, pad_id=PAD)
    with torch.no_grad(), pytest.raises(ValueError, match="causal attention only"):
        model(packed.input_ids, packed.positions, attn_mask=packed.attn_mask)
