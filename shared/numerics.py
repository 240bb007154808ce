"""The numerics of one precision flow, as the model and the engines take them: a small frozen value, free of torch and
of the config (`PrecisionConfig.numerics()` makes one; tests build them directly); and the quantization plan that
flow makes of a model (`quantization_plan` in shared/model/checkpoint.py derives one)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec

MASTERS = "fp32_masters"  # what jetroll's quantizer reads: the trainer's fp32 masters, never a rounded copy
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# linears that read the same input share one inference GEMM, so they share one format
FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
Mode = Literal["fp32", "bf16", "fp8_unified", "fp8_rollout_only"]
LinearFormat = Literal["fp32", "bf16", "fp8"]
RefitSource = Literal["fp32_masters", "bf16_copy"]


@dataclass(frozen=True, slots=True)
class Numerics:
    mode: Mode = "fp32"
    backend: Literal["fast", "exact"] = "fast"
    backward: Literal["fp8", "bf16"] = "fp8"
    fmt: Literal["e4m3"] = "e4m3"
    weight_block: int = 128
    act_group: int = 128
    scale_rounding: Literal["none", "pow2"] = "none"
    high_precision: tuple[str, ...] = ()  # block linears kept in bf16 in the FP8 modes
    refit_source: RefitSource = "fp32_masters"  # what a version after the base is quantized from (a fault to inject)

    def __post_init__(self) -> None:
        object.__setattr__(self, "high_precision", tuple(self.high_precision))  # hashable, whatever was passed
        if self.weight_block < 1 or self.act_group < 1 or self.weight_block % self.act_group:
            raise ValueError(f"precision.act_group ({self.act_group}) must divide precision.weight_block "
                             f"({self.weight_block}): the GEMM sums per activation group")
        unknown = sorted(set(self.high_precision) - set(BLOCK_LINEARS))
        if unknown:
            raise ValueError(f"precision.high_precision: unknown block linears {unknown}; valid: {list(BLOCK_LINEARS)}")
        for group in FUSED_LINEARS:
            if len({name in self.high_precision for name in group}) > 1:
                raise ValueError(f"precision.high_precision must list all of {list(group)} or none of them")
        if self.refit_source != MASTERS and not self.is_fp8:
            raise ValueError("precision.refit_source: bf16_copy misaligns FP8 refits; it needs an FP8 mode")

    @property
    def is_fp8(self) -> bool:
        return self.mode in ("fp8_unified", "fp8_rollout_only")

    def linear_format(self, name: str) -> LinearFormat:
        """The number format of block linear `name` on the rollout side, which is also the published format."""
        if self.mode in ("fp32", "bf16"):
            return self.mode
        return "bf16" if name in self.high_precision else "fp8"

    def trainer_side(self) -> Numerics:
        """The precision of the trainer's own passes: bf16 under fp8_rollout_only, else this one."""
        return replace(self, mode="bf16") if self.mode == "fp8_rollout_only" else self


PLAIN_DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}  # a format -> the torch dtype it is published in


class QuantizationPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a precision flow does to each parameter of a model. The trainer records it in every version it publishes;
    a rollout worker derives its own and refuses a version whose plan or tensors differ (docs/architecture.md, "The
    quantization plan"). The field's quiet FP8 failures are exclusions that differ between the two sides and
    quantizers that read different sources: neither fails anything, so both sides name them and compare."""

    source: str  # what the quantizer reads for the versions after the base: fp32_masters (or the bf16_copy fault)
    scale_format: str  # FP8 weight scales: fp32, or ue8m0 (powers of two)
    activation_group: int  # FP8 activations are quantized in groups of 1 x this along K
    params: dict[str, str]  # every published tensor but the scales -> its format: e4m3[128x128], bf16 or fp32

    @property
    def digest(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:12]

    def first_difference(self, other: QuantizationPlan, mine: str, theirs: str) -> str | None:
        """The first thing the two plans do differently, in words (`mine` and `theirs` say whose plan is whose);
        None when they agree."""
        for field in ("source", "scale_format", "activation_group"):
            if getattr(self, field) != getattr(other, field):
                return f"{field} is {getattr(self, field)} in {mine} and {getattr(other, field)} in {theirs}"
        for name in [*self.params, *(p for p in other.params if p not in self.params)]:
            if self.params.get(name) != other.params.get(name):
                return (f"{name} is {self.params.get(name, 'absent')} in {mine} and "
                        f"{other.params.get(name, 'absent')} in {theirs}")
        return None

    def check_tensors(self, tensors: Mapping[str, Any]) -> str | None:
        """What in `tensors` (a version's, by name) does not follow the plan, in words; None when all of it does."""
        for name, fmt in self.params.items():
            tensor = tensors.get(name)
            if tensor is None:
                return f"{name} is missing"
            if fmt in PLAIN_DTYPES:
                if str(tensor.dtype) != PLAIN_DTYPES[fmt]:
                    return f"{name} is {tensor.dtype}, and its plan says {fmt}"
                continue
            block = int(fmt.split("[", 1)[1].split("x", 1)[0])
            scales = tensors.get(_scale_name(name))
            expected = (math.ceil(tensor.shape[0] / block), math.ceil(tensor.shape[1] / block))
            if str(tensor.dtype) != "torch.float8_e4m3fn" or scales is None or tuple(scales.shape) != expected:
                found = "no scales" if scales is None else f"scales {tuple(scales.shape)}"
                return f"{name} is {tensor.dtype} with {found}, and its plan says {fmt} with scales {expected}"
        planned = set(self.params) | {_scale_name(n) for n, fmt in self.params.items() if fmt not in PLAIN_DTYPES}
        if stray := sorted(set(tensors) - planned):
            return f"{stray[0]} is not in the plan"
        return None


def _scale_name(weight: str) -> str:
    return weight.removesuffix("weight") + "weight_scale_inv"
