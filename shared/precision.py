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


# oneDNN's prepacked fp32 GEMM is about 2x MKL's at decode batch sizes on AVX-512 CPUs, slower for a row or two
PACKED_MIN_ROWS = 8
_HAS_ONEDNN = torch.backends.mkldnn.is_available()


# an opaque op to torch.compile, which has no lowering for a prepacked weight outside of freezing
@torch.library.custom_op("jetroll::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class InferenceWeights:
    """The rounded weights (and biases) of linears that read the same input, row-concatenated, for inference.

    Rounding per linear, then concatenating, gives the same products as running each linear alone, so
    q/k/v and gate/up share one GEMM in every mode. Rebuilt when any source tensor is replaced or
    written in place (`load_state` copies in place and bumps `_version`), so a swapped-in weight
    version is picked up at the next forward.
    """

    def __init__(self, *linears: PrecisionLinear) -> None:
        self.linears = linears
        self.key: tuple[int, ...] = ()
        self.weight = torch.empty(0)
        self.bias: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None

    def refresh(self) -> None:
        tensors = [t for lin in self.linears for t in (lin.weight, lin.bias) if t is not None]
        key = tuple(x for t in tensors for x in (t.data_ptr(), t._version))
        if key == self.key:
            return
        self.key = key
        self.weight = torch.cat([round_weight(lin.weight.detach(), lin.precision) for lin in self.linears])
        has_bias = self.linears[0].bias is not None
        self.bias = torch.cat([lin.bias.detach() for lin in self.linears]) if has_bias else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight) if _HAS_ONEDNN else None

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b for an already rounded activation x [..., K]."""
        if not torch.compiler.is_compiling():
            self.refresh()
        if self.packed is not None and x.numel() >= PACKED_MIN_ROWS * x.shape[-1]:
            return packed_linear(x, self.packed, self.bias, self.weight.shape[0])
        return F.linear(x, self.weight, self.bias)


def is_inference(linear: nn.Linear) -> bool:
    """True when no gradient flows to the weight: rollout, evaluation and the trainer's no-grad passes."""
    return not (torch.is_grad_enabled() and linear.weight.requires_grad)


class PrecisionLinear(nn.Linear):
    """A block linear whose GEMM follows the precision flow; bias and output stay fp32."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config: PrecisionConfig) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.precision = config
        # rollout decodes many steps per weight version: round (and pack) once per version of the tensor
        self.inference = InferenceWeights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_inference(self):
            return self.inference.linear(round_activation(x, self.precision))
        return F.linear(round_activation(x, self.precision), round_weight(self.weight, self.precision), self.bias)
