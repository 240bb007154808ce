"""The one precision flow, imported by rollout and the trainer alike: quantizer and block linear.

On the CPU every mode is emulated: operands are rounded to the mode's format (bf16, or e4m3 with
per-block scales) and products are accumulated in fp32. The `fast` backend dequantizes and runs
an fp32 matmul; gradients pass straight through to the fp32 master weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.config import PrecisionConfig

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_EPS = 1e-12


def quantize(
    x: torch.Tensor, block_rows: int, block_cols: int, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 quantization of a 2-D tensor.

    Returns q (e4m3, same shape as x) and the dequantization multipliers `scale_inv` of shape
    [ceil(rows / block_rows), ceil(cols / block_cols)]. Zero padding exists only inside.
    """
    assert x.dim() == 2, "quantize takes a 2-D tensor"
    rows, cols = x.shape
    pad_r, pad_c = -rows % block_rows, -cols % block_cols
    xp = F.pad(x.float(), (0, pad_c, 0, pad_r))
    nr, nc = xp.shape[0] // block_rows, xp.shape[1] // block_cols
    blocks = xp.view(nr, block_rows, nc, block_cols)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = amax.clamp(min=SCALE_EPS) / FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(nr * block_rows, nc * block_cols)[:rows, :cols]
    return q, scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return q.float() * expanded[:rows, :cols]


def _fake_quant(x: torch.Tensor, block_rows: int, block_cols: int, pow2: bool) -> torch.Tensor:
    q, scale_inv = quantize(x, block_rows, block_cols, pow2)
    return dequantize(q, scale_inv, block_rows, block_cols)


def _straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    return x + (rounded - x).detach() if x.requires_grad else rounded


def round_weight(weight: torch.Tensor, config: PrecisionConfig) -> torch.Tensor:
    """The weight as the mode's GEMM sees it (fp32 values), with a straight-through gradient."""
    if config.mode == "fp32":
        return weight
    if config.mode == "bf16":
        return _straight_through(weight, weight.detach().to(torch.bfloat16).float())
    block = config.weight_block
    rounded = _fake_quant(weight.detach(), block, block, config.scale_rounding == "pow2")
    return _straight_through(weight, rounded)


def round_activation(x: torch.Tensor, config: PrecisionConfig) -> torch.Tensor:
    """Activations [..., K]: bf16 rounding or 1 x act_group e4m3 groups along K."""
    if config.mode == "fp32":
        return x
    if config.mode == "bf16":
        return _straight_through(x, x.detach().to(torch.bfloat16).float())
    flat = x.detach().reshape(-1, x.shape[-1])
    rounded = _fake_quant(flat, 1, config.act_group, config.scale_rounding == "pow2").view(x.shape)
    return _straight_through(x, rounded)


class PrecisionLinear(nn.Linear):
    """A block linear whose GEMM follows the precision flow; bias and output stay fp32."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config: PrecisionConfig) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.precision = config
        self._cached: tuple[int, int, torch.Tensor] | None = None

    def _inference_weight(self) -> torch.Tensor:
        # rollout decodes many steps per weight version: quantize once per version of the tensor
        key = (self.weight.data_ptr(), self.weight._version)
        if self._cached is None or self._cached[:2] != key:
            self._cached = (*key, round_weight(self.weight.detach(), self.precision))
        return self._cached[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision.mode == "fp32":
            return F.linear(x, self.weight, self.bias)
        needs_grad = torch.is_grad_enabled() and self.weight.requires_grad
        weight = round_weight(self.weight, self.precision) if needs_grad else self._inference_weight()
        return F.linear(round_activation(x, self.precision), weight, self.bias)
