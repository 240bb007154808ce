"""Events for tests, built in one place: a trajectory, and a trajectory scored. Callers name what their test
depends on; the defaults make a valid event of the arithmetic task."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jetroll.shared.protocol.events import Array, ScoredEvent, TrajectoryEvent


def _per_token(values: Sequence[float] | float, n: int) -> list[float]:
    return [values] * n if isinstance(values, int | float) else list(values)


# `precision.mismatch` with its gates off: synthetic behaviour log-probs sit far from any model's, and a trainer that
# steps on them would (rightly) stop at the first gate
NO_MISMATCH_GATES = {"gate": {"k3": {"above": None}, "abs_mean": {"above": None}, "growth": {"above": None}}}


def trajectory(traj_id: str = "g1:0", completion_ids: Sequence[int] = (9, 1), *, job_id: str = "j",
               task: str = "arithmetic", prompt: str = "1+1=", answer: str = "2",
               prompt_ids: Sequence[int] = (5, 6, 7, 8), behavior_logprobs: Sequence[float] | float = -0.5,
               v_tok: Sequence[int] | int = 0, loss_mask: Sequence[int] | None = None, v_adm: int = 0,
               group_size: int = 2, **fields: Any) -> TrajectoryEvent:
    """A trajectory `{group_id}:{sample}`; per-token fields take one value for every token, or a list."""
    n = len(completion_ids)
    group_id, _, sample = traj_id.rpartition(":")
    return TrajectoryEvent(
        job_id=job_id, traj_id=traj_id, group_id=group_id, sample=int(sample), task=task, pool="default",
        prompt=prompt, answer=answer, prompt_ids=Array.of(list(prompt_ids), "<i4"),
        completion_ids=Array.of(list(completion_ids), "<i4"),
        loss_mask=Array.of(list(loss_mask) if loss_mask is not None else [1] * n, "<u1"),
        behavior_logprobs=Array.of(_per_token(behavior_logprobs, n), "<f4"),
        v_tok=Array.of([int(v) for v in _per_token(v_tok, n)], "<i4"), v_adm=v_adm, group_size=group_size,
        temperature=1.0, top_p=1.0, precision_id="p", finish_reason="stop", **fields)


def sample_with_versions(group: str, sample: int, v_tok: list[int], v_adm: int = 0, task: str = "arithmetic",
                         loss_mask: list[int] | None = None, group_size: int = 2) -> TrajectoryEvent:
    """Sample `sample` of `group`, one completion token per entry of `v_tok` (the version that sampled it)."""
    return trajectory(f"{group}:{sample}", [5] * len(v_tok), task=task, prompt_ids=[3, 4], behavior_logprobs=-1.0,
                      v_tok=v_tok, loss_mask=loss_mask, v_adm=v_adm, group_size=group_size)


def scored(traj: TrajectoryEvent, reward: float = 1.0, **fields: Any) -> ScoredEvent:
    """`traj` scored `ok` by the local backend."""
    return ScoredEvent(**{"job_id": traj.job_id, "trajectory": traj, "reward": reward, "status": "ok",
                          "attempts": 1, "backend": "local", "latency_s": 0.0, **fields})
