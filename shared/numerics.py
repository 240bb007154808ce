"""The numerics of one precision flow, as the model and the engines take them: a small frozen value, free of torch and
of the config (`PrecisionConfig.numerics()` makes one; tests build them directly)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# linears that read the same input share one inference GEMM, so they share one format
FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
Mode = Literal["fp32", "bf16", "fp8_unified", "fp8_rollout_only"]
LinearFormat = Literal["fp32", "bf16", "fp8"]


@dataclass(frozen=True, slots=True)
class Precision:
    mode: Mode = "fp32"
    backend: Literal["fast", "exact"] = "fast"
    backward: Literal["fp8", "bf16"] = "fp8"
    fmt: Literal["e4m3"] = "e4m3"
    weight_block: int = 128
    act_group: int = 128
    scale_rounding: Literal["none", "pow2"] = "none"
    high_precision: tuple[str, ...] = ()  # block linears kept in bf16 in the FP8 modes

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

    @property
    def is_fp8(self) -> bool:
        return self.mode in ("fp8_unified", "fp8_rollout_only")

    def linear_format(self, name: str) -> LinearFormat:
        """The number format of block linear `name` on the rollout side, which is also the published format."""
        if self.mode in ("fp32", "bf16"):
            return self.mode
        return "bf16" if name in self.high_precision else "fp8"

    def trainer_side(self) -> Precision:
        """The precision of the trainer's own passes: bf16 under fp8_rollout_only, else this one."""
        return replace(self, mode="bf16") if self.mode == "fp8_rollout_only" else self
