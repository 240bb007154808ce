"""The learning-rate schedule of both optimizers: the SFT warm start's and the RL trainer's."""

from __future__ import annotations

import math

from jetroll.shared.config.trainer import TrainerConfig


def cosine_lr(step: int, num_steps: int, peak_lr: float, *, warmup_steps: int, final_ratio: float,
              hold_steps: int = 0) -> float:
    """Linear warmup over the first `warmup_steps`, the peak for `hold_steps` more, then cosine decay from the peak
    towards `final_ratio` x the peak, which step `num_steps` would reach. `step` counts from 0."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_start = warmup_steps + hold_steps
    progress = max(0, step - decay_start) / max(1, num_steps - decay_start)
    return peak_lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def trainer_lr(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of the trainer's step `step` (from 0) under the job's schedule."""
    decay_start = cfg.max_steps if cfg.lr_schedule == "constant" else round(cfg.max_steps * (1 - cfg.lr_decay_frac))
    return cosine_lr(step, cfg.max_steps, cfg.lr, warmup_steps=cfg.warmup_steps, final_ratio=cfg.lr_final_ratio,
                     hold_steps=max(0, decay_start - cfg.warmup_steps))
