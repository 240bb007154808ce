"""precision: the one precision flow of rollout and the trainer's forward, and the loss's correction."""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import Field, model_validator

from jetroll.shared.numerics import BLOCK_LINEARS, MASTERS, Numerics, RefitSource
from jetroll.shared.schema import Strict

BlockLinear = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


GateAction = Literal["warn", "fail"]
ACTION = ("warn: a warning in the trainer's log; fail: the job stops with one line naming the figure, its value and "
          "the threshold. Either way the step's metrics carry `mismatch_gate/<gate>` = 1")


class GateConfig(Strict):
    """A gate on one figure of each measured step: trips past `above`."""

    above: float | None = Field(None, gt=0, description="the value past which the gate trips; None: off")
    action: GateAction = Field("fail", description=ACTION)


# The defaults come from the measured steps of every mode (docs/results.md, "Mismatch in async runs" and the precision
# bench): no step of any mode but the misaligned refit passed k3 0.051 (fp8_rollout_only with count32's long
# outputs) or mean |delta logp| 0.091, and the growth gate caught the misaligned refit at step 2 (step 5 in the
# async default job); its floor keeps a vLLM FP8 job's step-to-step noise (k3 1e-5 to 4e-4, a 9.5x growth over a
# 1e-5 floor) out
class K3Gate(GateConfig):
    above: float | None = Field(0.1, gt=0, description="a measured step's k3 past which the gate trips: a backstop "
                                "for gross errors, twice the highest step of fp8_rollout_only (NeMo-RL gates at "
                                "0.003-0.004 and prime-rl at 0.005 on longer outputs and larger models); None: off")


class AbsMeanGate(GateConfig):
    above: float | None = Field(0.2, gt=0, description="a measured step's mean |delta logp| past which the gate "
                                "trips; None: off")
    action: GateAction = Field("warn", description=ACTION)


class GrowthGate(GateConfig):
    """The growth of k3 over training: the mean of the latest `window` measured steps over the mean of the first
    `window` (while fewer than 2 x window are measured, the first ones against the rest: at the second measured step
    it is the step-2 / step-1 ratio, the earliest signal)."""

    above: float | None = Field(10.0, gt=0, description="the growth (a ratio) past which the gate trips; None: off")
    window: int = Field(10, ge=1, description="measured steps averaged at each end")
    floor: float = Field(1e-4, gt=0, description="k3 below this is rounding noise: the baseline counts as at least "
                         "this, and a latest mean below it never trips")


class MismatchGates(Strict):
    """`precision.mismatch.gate`: thresholds on each measured step's k3 and mean |delta logp|, and on k3's growth."""

    k3: K3Gate = Field(default_factory=K3Gate)
    abs_mean: AbsMeanGate = Field(default_factory=AbsMeanGate)
    growth: GrowthGate = Field(default_factory=GrowthGate)


class MismatchConfig(Strict):
    """How the trainer measures the precision mismatch (docs/architecture.md, "Measuring the mismatch")."""

    sample: float = Field(
        0.0625, ge=0, le=1, description="share of each async batch's rows scored at the weight version that sampled "
        "them, so that the mismatch is measured apart from staleness: one version a step, one no-grad pass while "
        "the trainer waits for its next groups, the masters of the last eta_hard + 1 versions kept; 0 measures only "
        "the tokens of the trainer's own version that the step scores anyway. Sync mode scores every row whatever "
        "this is")
    gate: MismatchGates = Field(default_factory=MismatchGates)


class PrecisionConfig(Strict):
    """One precision flow shared by rollout and the trainer's forward pass (docs/architecture.md, "Precision").

    Embeddings, lm_head, norms, the attention softmax and the logits always stay fp32; the block linears
    (q, k, v, o, gate, up, down) run in the mode's format unless listed in `high_precision`.
    """

    mode: Literal["fp32", "bf16", "fp8_unified", "fp8_rollout_only"] = Field(
        "fp32", description="fp32 (reference); bf16; fp8_unified (rollout and the trainer's forward share one FP8 "
        "flow); fp8_rollout_only (the failing baseline: FP8 rollout, bf16 trainer)")
    backend: Literal["fast", "exact"] = Field(
        "fast", description="CPU backend of no-grad passes: fast (fake-quant + fp32 GEMM, compiled decode) or exact "
        "(bitwise batch-invariant reference: decode and the trainer's log-probs agree to the bit; several x slower)")
    backward: Literal["fp8", "bf16"] = Field(
        "fp8", description="FP8 linears' backward GEMMs: fp8 (DGrad = Q1x128(dY) W, WGrad = Q1x128(dY^T) Q128x1(X)) "
        "or bf16 (dY and the operands rounded to bf16)")
    fmt: Literal["e4m3"] = Field("e4m3", description="FP8 format (max 448, round to nearest even)")
    weight_block: int = Field(128, ge=1, description="weight quantization block (square), as weight_block_size")
    act_group: int = Field(128, ge=1, description="activation quantization group along K; divides weight_block")
    scale_rounding: Literal["none", "pow2"] = Field(
        "none", description="round scales up to a power of two (ue8m0 scales, as DeepSeek-V3.1)")
    refit_source: RefitSource = Field(
        MASTERS, description="what the FP8 weights of every version after the base are quantized from: "
        "fp32_masters (what the trainer's forward quantizes), or bf16_copy: the misaligned refit behind one of the "
        "field's quiet FP8 failures, injected on purpose for `jetroll bench precision` and the mismatch gates' tests. "
        "Never train with it")
    high_precision: list[BlockLinear] = Field(
        default_factory=list, description=f"block linears kept in bf16 in the FP8 modes, from {list(BLOCK_LINEARS)}; "
        "q/k/v and gate/up go together")
    correction: Literal["decoupled", "none", "token_tis", "seq_mis", "icepop"] = Field(
        "decoupled", description="the loss's correction for the rollout/trainer gap r = pi_prox / mu (precision and "
        "staleness): decoupled (w = min(r, correction_cap), tokens with r outside decoupled_band masked), none "
        "(w = 1), token_tis (w = min(r, correction_cap)), seq_mis (w = the sequence's product of r; sequences above "
        "correction_cap masked), icepop (w = r; tokens with r outside icepop_band masked)")
    correction_cap: float = Field(2.0, gt=0, description="C: the cap of w in decoupled and token_tis, and the "
                                  "bound on seq_mis's sequence weight")
    decoupled_band: tuple[float, float] = Field((0.0, 10.0), description="decoupled keeps tokens with r in "
                                                "[low, high]")
    icepop_band: tuple[float, float] = Field((0.5, 2.0), description="icepop keeps tokens with r in [low, high]")
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)

    @model_validator(mode="after")
    def _consistent(self) -> PrecisionConfig:
        self.numerics()  # the numeric settings check themselves
        for name in ("decoupled_band", "icepop_band"):
            low, high = getattr(self, name)
            if not 0 <= low < high:
                raise ValueError(f"precision.{name} must be (low, high) with 0 <= low < high")
        return self

    def precision_id(self, plan_digest: str) -> str:
        """Hash of the numeric precision config (the loss's correction and the mismatch's measurement aside) and of
        the quantization plan it makes of the job's model (`QuantizationPlan.digest`): every published version's
        manifest and every trajectory of jetroll's engine carry it."""
        numeric = self.model_dump_json(exclude={"correction", "correction_cap", "decoupled_band", "icepop_band",
                                                "mismatch"})
        return hashlib.sha256(f"{numeric}:{plan_digest}".encode()).hexdigest()[:12]

    def rollout_precision_id(self, engine: str, plan_digest: str) -> str:
        """What a rollout engine stamps on its trajectories: jetroll's engine runs the trainer's own numerics, so it
        keeps `precision_id`; another engine runs them its own way, and its id says which."""
        if engine == "jetroll":
            return self.precision_id(plan_digest)
        return hashlib.sha256(f"{self.precision_id(plan_digest)}:{engine}".encode()).hexdigest()[:12]

    def numerics(self) -> Numerics:
        """What the model and the engines compute with."""
        return Numerics(mode=self.mode, backend=self.backend, backward=self.backward, fmt=self.fmt,
                         weight_block=self.weight_block, act_group=self.act_group, scale_rounding=self.scale_rounding,
                         high_precision=tuple(self.high_precision), refit_source=self.refit_source)
