"""The compiled decode's CPU attention kernel against the matmul attention it replaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jetroll.shared.model.decode_attention import decode_attention, kernel, supports


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
              scale: float) -> torch.Tensor:
    """fp64 attention of each row over its own positions, [n, KV, G, D]."""
    rows = []
    for i, length in enumerate(lengths.tolist()):
        k, v = k_cache[i, :, :length].double(), v_cache[i, :, :length].double()  # [KV, L, D]
        probs = torch.softmax(q[i].double() @ k.transpose(-1, -2) * scale, dim=-1)  # [KV, G, L]
        rows.append(probs @ v)
    return torch.stack(rows).float()


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 2, 64), (1, 4, 16), (3, 1, 24)])
def test_the_kernel_attends_each_row_over_its_own_positions(kv_heads: int, group: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(kv_heads * 100 + head_dim)
    # rows 0..6 of 9 slots; ragged lengths: 1, at max_len, below it, and not multiples of the kernel's 4-row blocks
    slots, max_len, n = 9, 70, 7
    k_cache = torch.randn(slots, kv_heads, max_len, head_dim, generator=generator)
    v_cache = torch.randn(slots, kv_heads, max_len, head_dim, generator=generator)
    q = torch.randn(n, kv_heads, group, head_dim, generator=generator) * 3  # peaked softmaxes too
    lengths = torch.tensor([1, 5, 70, 33, 4, 64, 2])
    scale = head_dim**-0.5
    got = decode_attention(q, k_cache, v_cache, lengths, scale)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, lengths, scale), atol=2e-6, rtol=2e-5)
    # a row's result does not depend on the rows decoded beside it: bitwise alone or in the batch
    for i in (0, 2, 6):
        alone = decode_attention(q[i : i + 1], k_cache[i : i + 1], v_cache[i : i + 1], lengths[i : i + 1], scale)
        assert torch.equal(alone[0], got[i])
    # positions past a row's length are never read
    k_cache[:, :, 70 - 1 :] = float("nan")
    v_cache[0, :, 1:] = float("nan")
    shorter = decode_attention(q, k_cache, v_cache, lengths.clamp(max=69), scale)
    assert not shorter.isnan().any()


def test_the_kernel_refuses_what_it_cannot_run() -> None:
    q, cache = torch.zeros(2, 1, 2, 64), torch.zeros(2, 1, 8, 64)
    with pytest.raises(RuntimeError, match="length 9 outside 1..8"):
        decode_attention(q, cache, cache, torch.tensor([3, 9]), 1.0)
    with pytest.raises(RuntimeError, match="length 0 outside"):
        decode_attention(q, cache, cache, torch.tensor([0, 1]), 1.0)
    assert supports(q, cache)
    assert not supports(q.bfloat16(), cache)  # the caller keeps the matmuls for these
    assert not supports(torch.zeros(2, 1, 2, 12), torch.zeros(2, 1, 8, 12))


def test_a_kernel_that_cannot_build_stops_with_one_line_naming_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-g++"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    kernel.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"did not build \(.*\); .*or set rollout.compile=false$") as caught:
            kernel()
        assert "\n" not in str(caught.value)
    finally:
        kernel.cache_clear()  # the next caller loads the real build again
