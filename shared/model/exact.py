"""The `exact` CPU backend: bitwise batch-invariant kernels for every op on the log-prob path.

Stock CPU kernels change their reduction order with the number of rows (an fp32 GEMM row differs between 1 and >= 2
rows, decode SDPA differs from causal SDPA) and take vector or scalar code paths for exp/log by an element's place in
the tensor. Here every sum is either exact or taken in a fixed order that only depends on the reduced length, and every
transcendental function is built from correctly rounded +, -, *, /:

- Dot products: operands are block-scaled integers (e4m3 values, or bf16/fp32 aligned to a power-of-two grid per
  block), so each block's partial sum is exact in fp64 whatever order BLAS takes. Partials are scaled and added
  over blocks by `fold_sum`, whose result does not change when zeros are appended (masked cache positions).
- exp and log: range reduction and fixed polynomials in fp64.
- Softmax denominators: probabilities on a 2^-40 grid, summed exactly.

So a row's result never depends on the other rows, the batch size, the padding, the thread count, or whether a
sequence is decoded one token at a time or scored in one causal pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# bits per aligned operand and block length along K, so that a block's sum of products stays below 2^53
BF16_BLOCK, BF16_BITS = 128, 23  # 2 * 23 + 7 = 53; bf16 values within 16 binades of the block max are exact
FP32_BLOCK, FP32_BITS = 32, 24  # 2 * 24 + 5 = 53
PROB_BITS = 40  # softmax probabilities on a 2^-40 grid: sums of up to 8192 positions stay exact
MAX_CHUNK_ELEMENTS = 1 << 23  # fp64 elements of one chunk's partial products (64 MiB)
ATTENTION_CHUNK = 64  # queries per attention chunk

_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that n * _LN2_HI is exact (fdlibm)
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_SQRT_HALF = math.sqrt(0.5)
_EXP_COEFFS = [1.0 / math.factorial(i) for i in range(13, -1, -1)]  # Taylor to r^13 on |r| <= ln2 / 2
_ATANH_COEFFS = [1.0 / (2 * i + 1) for i in range(11, -1, -1)]  # log(m) = 2 atanh(t), |t| <= 0.172


def pow2(exponent: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """2^exponent built from its bits (exponent must be in the normal range of `dtype`), so it is exact."""
    if dtype == torch.float32:
        return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)
    assert dtype == torch.float64
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def align(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as integers (fp64) [..., K'] times power-of-two scales [..., K' / block], K' = K padded to `block`.

    Each block's max maps below 2^bits; values within `bits` binades of it are exact, smaller ones round to even.
    """
    x = x.double()
    if x.shape[-1] % block:
        x = F.pad(x, (0, -x.shape[-1] % block))
    blocks = x.unflatten(-1, (-1, block))
    _, exponent = torch.frexp(blocks.abs().amax(-1))  # amax < 2^exponent (0 for an all-zero block)
    ints = torch.round(blocks * pow2(bits - exponent)[..., None])
    return ints.flatten(-2), pow2(exponent - bits)


def fold_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` by folding halves of the zero-padded power-of-two length: a fixed order, and appending zeros
    leaves the result unchanged, so a decode row over its cache and a causal row over a longer sequence agree."""
    size = x.shape[dim]
    if size == 1:
        return x.select(dim, 0) + 0.0
    half = 1 << ((size - 1).bit_length() - 1)  # half the padded length; the padding zeros are never added
    acc = x.narrow(dim, 0, half).clone()
    acc.narrow(dim, 0, size - half).add_(x.narrow(dim, half, size - half))
    while half > 1:
        half //= 2
        acc.narrow(dim, 0, half).add_(acc.narrow(dim, half, half))
    return acc.select(dim, 0) + 0.0  # + 0.0 turns a -0 into +0, whatever shape the tree had


def block_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor | None, block: int
) -> torch.Tensor:
    """sum_k a[..., m, k] b[..., n, k] in fp64 for block-scaled operands.

    a [..., M, K] and b [..., N, K] hold values whose products sum exactly in fp64 within each `block` of K;
    a_scale [..., M, K / block] and b_scale [..., N, K / block] multiply each block's partial sum. Batch dims broadcast.
    """
    a_blocks = a.unflatten(-1, (-1, block)).transpose(-3, -2)  # [..., KB, M, block]
    b_blocks = b.unflatten(-1, (-1, block)).transpose(-3, -2)  # [..., KB, N, block]
    partial = torch.matmul(a_blocks, b_blocks.transpose(-1, -2))  # [..., KB, M, N], exact
    partial = partial * a_scale.transpose(-1, -2)[..., None]
    if b_scale is not None:
        partial = partial * b_scale.transpose(-1, -2)[..., None, :]
    return fold_sum(partial, dim=-3)


def matmul_rows(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, block: int
) -> torch.Tensor:
    """`block_matmul` of 2-D operands a [M, K], b [N, K] -> fp32 [M, N], in row chunks that bound memory."""
    rows = max(1, MAX_CHUNK_ELEMENTS // max(1, b.shape[0] * (b.shape[1] // block)))
    out = [block_matmul(a[i : i + rows], a_scale[i : i + rows], b, b_scale, block) for i in range(0, a.shape[0], rows)]
    return torch.cat(out).float() if out else a.new_zeros((0, b.shape[0]), dtype=torch.float32)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) with fp32 operands: the high-precision GEMM (lm_head)."""
    flat = x.reshape(-1, x.shape[-1])
    out = matmul_rows(*align(flat, FP32_BLOCK, FP32_BITS), *align(weight, FP32_BLOCK, FP32_BITS), FP32_BLOCK)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


def _horner(coeffs: list[float], x: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        out.mul_(x).add_(c)
    return out


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x in fp64 (relative error ~1e-16); inputs below -708 give e^-708 (callers mask or round those away)."""
    x = x.double().clamp(-708.0, 709.0)
    n = torch.round(x * _INV_LN2)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    return _horner(_EXP_COEFFS, r) * pow2(n)


def log(x: torch.Tensor) -> torch.Tensor:
    """ln x in fp64 for x > 0."""
    mantissa, exponent = torch.frexp(x.double())  # x = m 2^e, m in [0.5, 1)
    is_low = mantissa < _SQRT_HALF
    mantissa = torch.where(is_low, mantissa * 2.0, mantissa)  # now in [sqrt(1/2), sqrt(2))
    e = (exponent - is_low.int()).double()
    t = (mantissa - 1.0) / (mantissa + 1.0)
    return e * _LN2_HI + (e * _LN2_LO + 2.0 * t * _horner(_ATANH_COEFFS, t * t))


def silu(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return (x64 / (1.0 + exp(-x64))).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    mean_square = fold_sum(x64 * x64, dim=-1) / x.shape[-1]
    inv_rms = 1.0 / torch.sqrt(mean_square + eps)
    return weight * (x64 * inv_rms[..., None]).to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, fp32 out."""
    x64 = x.double()
    z = x64 - x64.amax(-1, keepdim=True)
    return (z - log(fold_sum(exp(z), dim=-1))[..., None]).float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of q [B, KV, G, T, D] over k, v [B, KV, L, D]; query (b, t) sees positions 0..q_pos[b, t].

    Positions past a query's own (future tokens, another sequence's stale cache) never touch its result. fp32 out.
    """
    bsz, num_kv, group, num_q, dim = q.shape
    k_ints, k_scales = align(k, FP32_BLOCK, FP32_BITS)
    v_ints, v_scales = align(v, dim, FP32_BITS)  # one scale per position, which folds into its weight
    # query chunks see only the keys up to their last position: a causal pass does about half the work
    rows = min(ATTENTION_CHUNK, max(1, MAX_CHUNK_ELEMENTS // (bsz * num_kv * group * k.shape[2])))
    out = []
    for start in range(0, num_q, rows):
        pos = q_pos[:, start : start + rows]
        length = int(pos.max()) + 1  # dropping the keys no query of the chunk sees only removes zeros
        chunk = q[..., start : start + rows, :]
        # the G query heads of a kv head are rows of one GEMM: [B, KV, G * t, D], positions [B, G * t]
        out.append(_attention_rows(chunk.flatten(2, 3), pos.repeat(1, group), k_ints[:, :, :length],
                                   k_scales[:, :, :length], v_ints[:, :, :length], v_scales[:, :, :length, 0],
                                   scale).unflatten(2, (group, -1)))
    return torch.cat(out, dim=-2)


def _attention_rows(
    q: torch.Tensor, q_pos: torch.Tensor, k_ints: torch.Tensor, k_scales: torch.Tensor, v_ints: torch.Tensor,
    v_scales: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [B, KV, R, D] with positions [B, R] over aligned k, v [B, KV, L, D'] and v's per-position scales [B, KV, L]."""
    length = k_ints.shape[2]
    q_ints, q_scales = align(q, FP32_BLOCK, FP32_BITS)
    scores = block_matmul(q_ints, q_scales, k_ints, k_scales, FP32_BLOCK) * scale  # [B, KV, R, L]
    is_visible = torch.arange(length, device=q_pos.device) <= q_pos[:, None, :, None]  # [B, 1, R, L]
    scores = scores.masked_fill(~is_visible, float("-inf"))
    probs = exp(scores - scores.amax(-1, keepdim=True))
    prob_ints = torch.round(probs * 2.0**PROB_BITS).masked_fill(~is_visible, 0.0)
    # sum_s p_s v_s = sum_s (p_s * v_scale_s) * v_ints_s: align those weights per block of 32 positions
    w_ints, w_scales = align(prob_ints * v_scales[:, :, None, :], FP32_BLOCK, FP32_BITS)
    v_cols = F.pad(v_ints.transpose(-1, -2), (0, w_ints.shape[-1] - length))  # [B, KV, D, L']
    numerator = block_matmul(w_ints, w_scales, v_cols, None, FP32_BLOCK)  # [B, KV, R, D]
    return (numerator / prob_ints.sum(-1, keepdim=True)).float()  # an integer sum: exact in any order
