"""trainer: the RL algorithm's knobs, the optimizer and the schedule."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from jetroll.shared.schema import Strict


class TrainerConfig(Strict):
    """Decoupled PPO with GRPO advantages on fp32 master weights."""

    max_steps: int = Field(60, ge=1, description="trainer steps, one batch and one weight version each")
    updates_per_batch: int = Field(
        1, ge=1, description="optimizer updates on each batch before its version is published (PPO epochs): the "
        "ratio to pi_prox, the weights at the batch's start, is clipped in every update. More learning per sample "
        "where the trainer waits on rollout anyway")
    groups_per_step: int = Field(16, ge=1, description="B: groups per optimizer step")
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO group)")
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate (the peak, under a cosine schedule)")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="cosine: decay from `lr` at step 0 to lr x lr_final_ratio at max_steps; annealing "
        "averages out the sampling noise of the last updates")
    lr_final_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the final lr as a fraction of `lr`")
    lr_decay_frac: float = Field(1.0, gt=0, le=1, description="cosine: the decay spans this last fraction of "
                                 "max_steps; before it the lr holds at `lr` (stable, then decay)")
    warmup_steps: int = Field(0, ge=0, description="linear lr warm-up over the first steps, in either schedule: "
                              "Adam's first updates move every weight by about lr whatever its gradient's size; a "
                              "cosine decay starts after it at the latest")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="global grad-norm clip")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip, low side")
    clip_eps_high: float = Field(0.28, gt=0, description="PPO ratio clip, high side")
    dual_clip_c: float = Field(3.0, gt=1, description="dual clip bound for negative advantages")
    advantage: Literal["grpo", "dr_grpo"] = Field(
        "grpo", description="grpo: (r - mean) / std per group, the loss over the batch's policy tokens; dr_grpo: "
        "r - mean, the loss over batch x max_new_tokens (each sample's generation budget: its task's max_new_tokens, "
        "capped by rollout.max_new_tokens)")
    kl_coef: float = Field(0.0, ge=0, description="KL to the reference (base) policy; 0 disables")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: subtracts coef x the token entropy of pi_theta "
                                "from the loss of the groups with a gradient, so no digit's distribution collapses "
                                "onto a wrong answer before its reward signal arrives; 0 disables")
    task_quotas: bool = Field(True, description="each task gets its weight share of every step's groups and of the "
                              "admission window; a share a task leaves unused goes to the others' oldest groups")
    checkpoint_every: int = Field(20, ge=1, description="the trainer state is durable after every step, and only the "
                                  "newest store.keep_checkpoints of those are kept; every K-th step's state (and its "
                                  "published version) is also kept past retention, for evaluation and export")
    threads: int = Field(1, ge=1, description="torch threads for the trainer")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="where the policy, its reference, "
                        "gradients and optimizer state live: cpu, or cuda[:N] (a CUDA build of torch); checkpoints "
                        "and published versions are written from the host either way")
    engine: Literal["jetroll", "timing"] = Field(
        "jetroll", description="jetroll: forward/backward and an optimizer step (`real`, its old name, still reads "
        "as it); timing: a sleep instead (weights unchanged), keeping the ledger, acks, metrics and weight "
        "publication (benchmarks)")
    timing_step_s: float = Field(1.0, gt=0, description="trainer.engine timing: modelled time of a step plus its "
                                 "weight publication; the sleep is what the last real publication leaves of it")

    @field_validator("engine", mode="before")
    @classmethod
    def _real_is_jetroll(cls, value: object) -> object:
        # YAML keys stay: a config written before the rename keeps working (rollout's `real` is refused with a hint)
        return "jetroll" if value == "real" else value
