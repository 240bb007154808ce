"""The learning-rate schedule of both optimizers: the SFT warm start's and the RL trainer's."""

from __future__ import annotations

import math


def cosine_lr(step: int, num_steps: int, peak_lr: float, *, warmup_steps: int, final_ratio: float) -> float:
    """Linear warmup over the first `warmup_steps`, then cosine decay from the peak towards `final_ratio` x the peak,
    which step `num_steps` would reach. `step` counts from 0."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return peak_lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
