"""The one precision flow, imported by rollout and the trainer alike: the quantizer, the block linear and its GEMMs.

On the CPU every mode is emulated: operands are rounded to the linear's format (bf16, or e4m3 with per-block scales).
No-grad passes run one of two GEMM backends: `fast` dequantizes and runs an fp32 GEMM (oneDNN-prepacked at decode
batch sizes), `exact` sums products exactly per block (exact.py) and is bitwise batch-invariant. The gradient pass
always runs `fast` with the backward GEMMs of `precision.backward`, straight through to the fp32 master weights.
A GPU backend (TransformerEngine, DeepGEMM) slots in as a third `InferenceWeights` backend with this quantizer.
"""

from __future__ import annotations

import weakref
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from jetroll.shared.model import exact
from jetroll.shared.numerics import Numerics

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_EPS = 1e-12
Format = Literal["fp32", "bf16", "fp8"]


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (positive fp32), from frexp: log2/exp2 kernels may round differently by path."""
    mantissa, exponent = torch.frexp(x)
    return exact.pow2(exponent - (mantissa == 0.5).int(), torch.float32)


def quantize(
    x: torch.Tensor, block_rows: int, block_cols: int, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 quantization of a 2-D tensor.

    Returns q (e4m3, same shape as x) and the dequantization multipliers `scale_inv` of shape
    [ceil(rows / block_rows), ceil(cols / block_cols)]: scale = max(amax, eps) / 448 (rounded up to a power of two
    with `pow2`), q = clamp(x / scale, +-448) rounded to nearest even. Zero padding exists only inside.
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
        scale = pow2_ceil(scale)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(nr * block_rows, nc * block_cols)[:rows, :cols]
    return q, scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return q.float() * expanded[:rows, :cols]


def fake_quant(x: torch.Tensor, block_rows: int, block_cols: int, pow2: bool = False) -> torch.Tensor:
    q, scale_inv = quantize(x, block_rows, block_cols, pow2)
    return dequantize(q, scale_inv, block_rows, block_cols)


def round_activation(x: torch.Tensor, fmt: Format, config: Numerics) -> torch.Tensor:
    """Activations [..., K] as a `fmt` GEMM sees them (fp32 values): bf16, or 1 x act_group e4m3 groups along K."""
    if fmt == "fp32":
        return x
    if fmt == "bf16":
        return x.to(torch.bfloat16).float()
    flat = x.reshape(-1, x.shape[-1])
    return fake_quant(flat, 1, config.act_group, config.scale_rounding == "pow2").view(x.shape)


def use_exact(config: Numerics) -> bool:
    """Whether an op runs on the exact backend: configured so, in a no-grad pass (rollout, the trainer's log-probs)."""
    return config.backend == "exact" and not torch.is_grad_enabled()


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


class BlockLinearFunction(torch.autograd.Function):
    """Y = round(X) round(W)^T + b. Backward: with `backward: fp8` on an FP8 linear, DGrad = Q1x128(dY) W128x128 and
    WGrad = Q1x128(dY^T) Q128x1(X) (groups along each GEMM's reduction dim); otherwise dY and the forward's operands
    rounded to bf16. Products accumulate in fp32; dX and dW pass straight through to X and the fp32 master W."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_hat: torch.Tensor,
        fmt: Format, config: Numerics,
    ) -> torch.Tensor:
        x_hat = round_activation(x, fmt, config)
        ctx.is_fp8 = fmt == "fp8" and config.backward == "fp8"
        ctx.config, ctx.has_bias = config, bias is not None
        ctx.save_for_backward(x if ctx.is_fp8 else x_hat, w_hat)
        return F.linear(x_hat, w_hat, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_hat = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1])  # [M, N]
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        if ctx.is_fp8:
            group, pow2 = ctx.config.act_group, ctx.config.scale_rounding == "pow2"
            dx = fake_quant(dy, 1, group, pow2) @ w_hat
            dw = fake_quant(dy.t(), 1, group, pow2) @ fake_quant(x2, group, 1, pow2)
        else:
            dy16 = _bf16(dy)
            dx, dw = dy16 @ _bf16(w_hat), dy16.t() @ _bf16(x2)
        db = dy.sum(0) if ctx.has_bias else None
        return dx.view(x.shape), dw, db, None, None, None


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


def _exact_operand(x: torch.Tensor, fmt: Format, config: Numerics) -> tuple[torch.Tensor, torch.Tensor, int]:
    """An exact-GEMM operand for x [M, K] (activations, or bf16/fp32 weights by row): integer-valued fp64 [M, K'],
    per-block scales [M, KB] and the block length."""
    if fmt == "fp8":
        q, scale_inv = quantize(x, 1, config.act_group, config.scale_rounding == "pow2")
        return F.pad(q.double(), (0, -x.shape[1] % config.act_group)), scale_inv.double(), config.act_group
    if fmt == "bf16":
        return *exact.align(x.to(torch.bfloat16), exact.BF16_BLOCK, exact.BF16_BITS), exact.BF16_BLOCK
    return *exact.align(x, exact.FP32_BLOCK, exact.FP32_BITS), exact.FP32_BLOCK


class InferenceWeights:
    """The rounded weights (and biases) of linears that read the same input, row-concatenated, for inference.

    Rounding per linear, then concatenating, gives the same products as running each linear alone, so
    q/k/v and gate/up share one GEMM in every mode. Rebuilt when any source tensor is replaced or
    written in place (`load_state` copies in place and bumps `_version`), so a swapped-in weight
    version is picked up at the next forward.
    """

    def __init__(self, *linears: PrecisionLinear) -> None:
        assert len({lin.fmt for lin in linears}) == 1, "fused linears share one format"
        # weakly: each PrecisionLinear owns one of these, and a cycle would keep a dropped model's weights resident
        # until the cyclic GC ran (1.4 GB in the launcher for the whole of a 0.5B-shape job)
        self._linears = tuple(weakref.ref(lin) for lin in linears)
        self.fmt: Format = linears[0].fmt
        self.config = linears[0].precision
        self.key: tuple[int, ...] = ()
        self.weight_t = torch.empty(0)  # [K, N]: a GEMM of a row or two reads it ~20% faster than [N, K]
        self.bias: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.exact_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # integer-valued [N, K'], scales [N, KB]
        self.masters_are_views = False  # set by `share_masters`
        self.packs = True  # oneDNN-packs its weight on CPU; `CausalLM.use_unpacked_weights` turns it off

    @property
    def linears(self) -> tuple[PrecisionLinear, ...]:
        return tuple(ref() for ref in self._linears)  # type: ignore[misc]  # their owner outlives this

    def share_masters(self) -> None:
        """For a model that never trains: from the next refresh on, each linear's master weight is a view of the
        rounded [K, N] copy, so the weights are held once, not twice. Rounding a rounded bf16 or fp32 weight changes
        nothing, so every product stays the same; FP8 weights and the exact backend keep their own masters."""
        self.masters_are_views = self.fmt != "fp8" and self.config.backend != "exact"
        self.key = ()

    def _key(self) -> tuple[int, ...]:
        tensors = [t for lin in self.linears for t in (lin.weight, lin.bias) if t is not None]
        generations = tuple(lin.generation for lin in self.linears)
        return generations + tuple(x for t in tensors for x in (t.data_ptr(), t._version))

    def release(self) -> None:
        """Drop the rounded and packed copies (the next forward rebuilds them): a trainer's no-grad pass uses a
        version once, and at 0.5B the copies are 2.9 GB. A shared master's [K, N] copy is the master: it stays."""
        self.key = ()
        if not self.masters_are_views:
            self.weight_t = torch.empty(0)
        self.bias = self.packed = self.exact_weight = None

    def refresh(self) -> None:
        key = self._key()
        if key == self.key:
            return
        # a shared master must stay writable by a `load_state` outside inference mode
        with torch.inference_mode(False), torch.no_grad():
            weight = torch.cat([lin.rounded_weight() for lin in self.linears])
            self.weight_t = weight.t().contiguous()
            if self.masters_are_views:
                widths = [lin.out_features for lin in self.linears]
                for lin, rows in zip(self.linears, self.weight_t.split(widths, 1), strict=True):
                    lin.weight.data = rows.t()  # the old master's storage goes with its last view
                key = self._key()
        self.key = key
        has_bias = self.linears[0].bias is not None
        self.bias = torch.cat([lin.bias.detach() for lin in self.linears]) if has_bias else None
        if self.config.backend == "exact":
            operands = [lin.exact_operands() for lin in self.linears]
            self.exact_weight = (torch.cat([w for w, _ in operands]), torch.cat([s for _, s in operands]))
        elif self.packs and _HAS_ONEDNN and weight.device.type == "cpu":  # oneDNN packs CPU weights only
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """round(x) @ W.T + b for x [..., K]."""
        if not torch.compiler.is_compiling():
            self.refresh()
        if use_exact(self.config):
            assert self.exact_weight is not None
            a, a_scale, block = _exact_operand(x.reshape(-1, x.shape[-1]), self.fmt, self.config)
            out = exact.matmul_rows(a, a_scale, *self.exact_weight, block).view(*x.shape[:-1], -1)
            return out + self.bias if self.bias is not None else out
        x = round_activation(x, self.fmt, self.config)
        if self.packed is not None and x.numel() >= PACKED_MIN_ROWS * x.shape[-1]:
            return packed_linear(x, self.packed, self.bias, self.weight_t.shape[1])
        out = x @ self.weight_t
        return out + self.bias if self.bias is not None else out


def is_inference(linear: nn.Linear) -> bool:
    """True when no gradient flows to the weight: rollout, evaluation and the trainer's no-grad passes."""
    return not (torch.is_grad_enabled() and linear.weight.requires_grad)


class PrecisionLinear(nn.Linear):
    """A block linear (`name`: q_proj ... down_proj) whose GEMM follows the precision flow; bias and output stay fp32.

    Its FP8 weight (e4m3 values and scale_inv) is computed once per version of the master weight, or adopted from a
    published checkpoint, so the published bytes, the trainer's forward and rollout all use the same tensors.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, config: Numerics, name: str) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.precision = config
        self.name = name
        self.fmt: Format = config.linear_format(name)
        self._fp8: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None  # (weight key, q, scale_inv)
        # bumped by `CausalLM.mark_weights_changed`: FSDP2 all-gathers a step's new weights into the same buffer
        # without bumping its version counter, so (data_ptr, _version) alone would keep the last step's e4m3 copy
        self.generation = 0
        # rollout decodes many steps per weight version: round (and pack) once per version of the tensor
        self.inference = InferenceWeights(self)

    def _weight_key(self) -> tuple[int, ...]:
        return self.generation, self.weight.data_ptr(), self.weight._version

    def release(self) -> None:
        """Drop this linear's e4m3 copy and its GEMM copies: a sharded block's are rebuilt at its next forward."""
        self._fp8 = None
        self.inference.release()

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """e4m3 values [out, in] and fp32 scale_inv [ceil(out / b), ceil(in / b)] of the current master weight."""
        if self._fp8 is None or self._fp8[0] != self._weight_key():
            block = self.precision.weight_block
            q, scale_inv = quantize(self.weight.detach(), block, block, self.precision.scale_rounding == "pow2")
            self._fp8 = (self._weight_key(), q, scale_inv)
        return self._fp8[1], self._fp8[2]

    def load_fp8(self, q: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Load a published FP8 weight: the master becomes its dequantized values, and the e4m3 tensors themselves
        are kept for the GEMMs (re-quantizing the master could move a scale by an ulp)."""
        block = self.precision.weight_block
        expected = (-(-self.out_features // block), -(-self.in_features // block))
        if q.dtype != FP8_DTYPE or q.shape != self.weight.shape or tuple(scale_inv.shape) != expected:
            raise ValueError(f"{self.name}: FP8 weight {q.dtype} {tuple(q.shape)} with scale_inv "
                             f"{tuple(scale_inv.shape)} does not fit a {tuple(self.weight.shape)} linear in "
                             f"{block}x{block} blocks (e4m3, scales {expected})")
        scale_inv = scale_inv.float()
        with torch.no_grad():
            self.weight.copy_(dequantize(q, scale_inv, block, block))
        self._fp8 = (self._weight_key(), q.to(self.weight.device), scale_inv.to(self.weight.device))

    def rounded_weight(self) -> torch.Tensor:
        """The weight as this linear's GEMM sees it (fp32 values, detached)."""
        if self.fmt == "fp8":
            block = self.precision.weight_block
            return dequantize(*self.quantized(), block, block)
        weight = self.weight.detach()
        return _bf16(weight) if self.fmt == "bf16" else weight

    def exact_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact GEMM's right operand: integer-valued fp64 [out, K'] and per-row block scales [out, KB]."""
        if self.fmt != "fp8":
            return _exact_operand(self.rounded_weight(), self.fmt, self.precision)[:2]
        q, scale_inv = self.quantized()
        block, group = self.precision.weight_block, self.precision.act_group
        num_groups = -(-self.in_features // group)
        scales = scale_inv.double().repeat_interleave(block, 0).repeat_interleave(block // group, 1)
        return F.pad(q.double(), (0, -self.in_features % group)), scales[: self.out_features, :num_groups]

    def published(self, config: Numerics, is_refit: bool = False) -> dict[str, torch.Tensor]:
        """This weight in the rollout format of the job's `config`: {weight} or {weight, weight_scale_inv}. A refit
        (a version after the base) under `refit_source: bf16_copy` quantizes a bf16 copy of the master: misaligned."""
        fmt = config.linear_format(self.name)
        assert (config.weight_block, config.scale_rounding) == (self.precision.weight_block,
                                                               self.precision.scale_rounding), "one quantization"
        if fmt == "fp8" and is_refit and config.refit_source == "bf16_copy":
            block = config.weight_block
            q, scale_inv = quantize(_bf16(self.weight.detach()), block, block, config.scale_rounding == "pow2")
            return {"weight": q.contiguous(), "weight_scale_inv": scale_inv.contiguous()}
        if fmt == "fp8":
            q, scale_inv = self.quantized()
            return {"weight": q.contiguous(), "weight_scale_inv": scale_inv.contiguous()}
        weight = self.weight.detach()
        return {"weight": (weight.to(torch.bfloat16) if fmt == "bf16" else weight).contiguous()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_inference(self):
            return self.inference.linear(x)
        if self.fmt == "fp32":
            return F.linear(x, self.weight, self.bias)
        return BlockLinearFunction.apply(x, self.weight, self.bias, self.rounded_weight(), self.fmt, self.precision)


def quantization_config(config: Numerics, ignored: list[str]) -> dict[str, Any] | None:
    """config.json's `quantization_config` for a checkpoint published under `config` (None when nothing is FP8), in
    the fields vLLM's Fp8Config and DeepSeek-V3 use; `ignored` names the block linears kept in bf16."""
    if config.mode not in ("fp8_unified", "fp8_rollout_only"):
        return None
    block = config.weight_block
    qc: dict[str, Any] = {"quant_method": "fp8", "fmt": config.fmt, "activation_scheme": "dynamic",
                          "weight_block_size": [block, block]}
    if config.scale_rounding == "pow2":
        qc["scale_fmt"] = "ue8m0"
    if ignored:
        qc["ignored_layers"] = qc["modules_to_not_convert"] = ignored
    return qc


def published_dtype(config: Numerics) -> str:
    """The manifest's dtype/scale format of a version published under `config`."""
    if config.mode in ("fp8_unified", "fp8_rollout_only"):
        block = config.weight_block
        return f"float8_e4m3fn+weight_scale_inv[{block}x{block}]" + (":pow2" if config.scale_rounding == "pow2" else "")
    return {"bf16": "bfloat16", "fp32": "float32"}[config.mode]
