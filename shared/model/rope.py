"""RoPE frequencies of the variants current Qwen and Llama checkpoints ship with: default, `linear`, `llama3` and
`yarn`, read from `rope_scaling` (`type` or `rope_type`) or transformers-5 `rope_parameters`, as transformers
computes them.

`dynamic` (NTK) is refused: it rescales the frequencies by the current sequence length, so a cached decode and the
full forward of one sequence use other frequencies by construction, and rollout log-probs could not equal the
trainer's (mu = pi_prox). Every other type is refused too, naming the supported ones.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

# the keys each type reads besides its name, rope_theta (kept in ModelArgs) and partial_rotary_factor (refused)
RUNTIME_KEYS = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"},
}
REQUIRED_KEYS = {"linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
                 "yarn": {"factor"}}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A RoPE variant's parameters, as its config names them (None: the type's default)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None) -> RopeScaling | None:
        """The variant a `rope_scaling` / `rope_parameters` dict names; None for the default RoPE. Refuses an
        unsupported type, a key its type does not read, and a missing one, each in one line."""
        if not params:
            return None
        params = {k: v for k, v in params.items() if k != "rope_theta"}
        names = {params.pop(k) for k in ("type", "rope_type") if k in params}
        if len(names) > 1:
            raise ValueError(f"rope_scaling names two types: {sorted(names)}")
        rope_type = names.pop() if names else "default"
        if (partial := params.pop("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported: jetroll rotates every head dim")
        if rope_type == "default":
            if params:
                raise ValueError(f"rope type 'default' takes no parameters, got {sorted(params)}")
            return None
        if rope_type == "dynamic":
            raise ValueError("rope type 'dynamic' is refused: it rescales RoPE by the current length, so a cached "
                             "decode and the full forward disagree by construction (rollout log-probs would not "
                             "equal the trainer's)")
        if rope_type not in RUNTIME_KEYS:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, {', '.join(RUNTIME_KEYS)}")
        if unknown := set(params) - RUNTIME_KEYS[rope_type]:
            raise ValueError(f"rope type {rope_type!r} does not read {sorted(unknown)}")
        if missing := {k for k in REQUIRED_KEYS[rope_type] if params.get(k) is None}:
            raise ValueError(f"rope type {rope_type!r} needs {sorted(missing)}")
        return cls(rope_type=rope_type, **params)

    def to_hf(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def inv_freq_and_scale(head_dim: int, theta: float, scaling: RopeScaling | None,
                       max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float64) and the factor cos and sin are multiplied by."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling.factor
    original = scaling.original_max_position_embeddings or max_position_embeddings
    if scaling.rope_type == "linear":
        return inv_freq / factor, 1.0
    if scaling.rope_type == "llama3":
        assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are interpolated by `factor`, short ones kept, and the band between them blended
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(is_medium, blended, scaled), 1.0
    # yarn: interpolate the dims that rotate few times over the original context, extrapolate the fast ones
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast or 32), correction_dim(scaling.beta_slow or 1)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated, float(attention)
