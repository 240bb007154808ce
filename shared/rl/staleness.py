"""Per-step staleness metrics (docs/architecture.md, "Staleness and versions"), from the trajectories of one step.

Token lag = the trainer's version at the consuming step - v_tok; a trajectory's lag is its largest token lag over
policy tokens (loss_mask = 1). Tokens with lag > eta_hard (their task's, `tasks[].max_staleness`) are masked from the
loss and counted here.

  lag_mean, lag_p50, lag_max         per-trajectory lag over the batch (and per task: `lag_mean/<task>` ...)
  lag_hist/<k>                       trajectories with lag k (summed over steps: the lag histogram of a run)
  token_lag_mean                     mean lag over policy tokens
  mixed_version_frac                 trajectories whose policy tokens span more than one version
  mixed_version_token_frac           policy tokens in such trajectories, over all policy tokens
  stale_masked_tokens, stale_masked_frac   policy tokens beyond eta_hard (masked), count and fraction
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import torch

from jetroll.shared.protocol.events import TrajectoryEvent


def staleness_stats(trajectories: list[TrajectoryEvent], version: int,
                    eta_hard: Mapping[str, int]) -> dict[str, float]:
    """The step's staleness metrics; `eta_hard` by task."""
    lags, by_task = [], defaultdict(list)
    num_tokens = num_masked = num_mixed_tokens = num_mixed = 0
    lag_sum = 0
    for traj in trajectories:
        v_tok = traj.v_tok.numpy()[traj.loss_mask.numpy() > 0].astype(np.int64)
        token_lag = version - v_tok
        lag = int(token_lag.max()) if token_lag.size else 0
        lags.append(lag)
        by_task[traj.task].append(lag)
        num_tokens += token_lag.size
        lag_sum += int(token_lag.sum())
        num_masked += int((token_lag > eta_hard[traj.task]).sum())
        if token_lag.size and v_tok.min() != v_tok.max():
            num_mixed += 1
            num_mixed_tokens += token_lag.size
    stats = {
        "token_lag_mean": lag_sum / max(num_tokens, 1),
        "mixed_version_frac": num_mixed / max(len(lags), 1),
        "mixed_version_token_frac": num_mixed_tokens / max(num_tokens, 1),
        "stale_masked_tokens": float(num_masked),
        "stale_masked_frac": num_masked / max(num_tokens, 1),
        **_lag_summary(lags, ""),
    }
    for task, task_lags in sorted(by_task.items()):
        stats |= _lag_summary(task_lags, f"/{task}")
    for lag, count in zip(*np.unique(lags, return_counts=True), strict=True):
        stats[f"lag_hist/{lag}"] = float(count)
    return stats


def _lag_summary(lags: list[int], suffix: str) -> dict[str, float]:
    values = np.asarray(lags or [0], dtype=np.float64)
    return {f"lag_mean{suffix}": float(values.mean()), f"lag_p50{suffix}": float(np.median(values)),
            f"lag_max{suffix}": float(values.max())}


def fresh_tokens(loss_mask: torch.Tensor, v_tok: torch.Tensor, version: int,
                 eta_hard: int | torch.Tensor) -> torch.Tensor:
    """The loss mask without the tokens more than eta_hard versions old (one bound, or one per row [B, 1]): the last
    resort of the staleness bound (staleness_stats counts them)."""
    lag = (version - v_tok) * loss_mask.long()
    is_too_stale = (lag > eta_hard) & (loss_mask > 0)
    return loss_mask * (~is_too_stale)
