"""Staleness rules on their own: per-step metrics, the trainer's oldest-first take with required groups, admission,
and the reference figures of `bench async` (S* and the event model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factories import sample_with_versions as trajectory
from factories import scored

from jetroll.bench.async_model import Durations, bound, expected_max_s, simulate
from jetroll.shared.config.rollout import TimingEngineConfig
from jetroll.shared.protocol.ids import group_id
from jetroll.shared.rl.admission import Admission
from jetroll.shared.rl.batch import GroupBuffer, collate
from jetroll.shared.rl.staleness import staleness_stats


def test_staleness_stats_lags_masks_and_histogram() -> None:
    trajectories = [
        trajectory("g1", 0, [5, 5, 5]),  # lag 0
        trajectory("g1", 1, [3, 4, 5]),  # lag 2, mixed
        trajectory("g2", 0, [1, 1, 2, 2], task="other"),  # lags 4, 4, 3, 3: all beyond eta_hard 2
        trajectory("g2", 1, [0, 5], loss_mask=[0, 1], task="other"),  # the env token (mask 0) does not count
    ]
    stats = staleness_stats(trajectories, version=5, eta_hard={"arithmetic": 2, "other": 2})
    assert stats["lag_max"] == 4 and stats["lag_mean"] == pytest.approx((0 + 2 + 4 + 0) / 4)
    assert stats["lag_hist/0"] == 2 and stats["lag_hist/2"] == 1 and stats["lag_hist/4"] == 1
    assert stats["stale_masked_tokens"] == 4  # v_tok 1, 1 (lag 4) and 2, 2 (lag 3)
    assert stats["stale_masked_frac"] == pytest.approx(4 / 11)
    assert stats["mixed_version_frac"] == pytest.approx(2 / 4)
    assert stats["mixed_version_token_frac"] == pytest.approx(7 / 11)
    assert stats["token_lag_mean"] == pytest.approx((0 + 3 + 14 + 0) / 11)
    assert stats["lag_max/arithmetic"] == 2 and stats["lag_max/other"] == 4 and stats["lag_p50/other"] == 2
    # a task with its own, larger bound: its lag-3 and lag-4 tokens are kept
    assert staleness_stats(trajectories, version=5, eta_hard={"arithmetic": 2, "other": 4})["stale_masked_tokens"] == 0


def test_take_oldest_waits_for_a_required_group() -> None:
    buffer = GroupBuffer()
    for group, v_adm in (("g2", 1), ("g3", 1)):
        for sample in range(2):
            buffer.add(f"{group}-{sample}", scored(trajectory(group, sample, [v_adm], v_adm=v_adm)))
    buffer.add("g1-0", scored(trajectory("g1", 0, [0])))  # the slow group: one sample of two
    assert buffer.take_oldest(1, frozenset({"g1"})) is None  # a newer complete group does not jump the bound
    taken = buffer.take_oldest(1)
    assert taken is not None and [g.group_id for g in taken] == ["g2"]
    buffer.add("g1-1", scored(trajectory("g1", 1, [0, 1, 2])))
    taken = buffer.take_oldest(1, frozenset({"g1"}))
    assert taken is not None and [g.group_id for g in taken] == ["g1"]


def test_required_groups_come_first_among_equal_versions() -> None:
    buffer = GroupBuffer()
    for group in ("g1", "g2", "g3"):
        for sample in range(2):
            buffer.add(f"{group}-{sample}", scored(trajectory(group, sample, [0])))
    taken = buffer.take_oldest(2, frozenset({"g3"}))
    assert taken is not None and {g.group_id for g in taken} == {"g1", "g3"}


def test_a_batch_is_in_admission_order_whatever_the_order_rewards_came_back() -> None:
    """Rewards finish out of order; the batch (and so every tensor of the step) follows the admission index, also
    past 10^7 where the ids grow a digit."""
    indices = [3, 9_999_999, 10_000_000, 12]
    layouts = []
    for arrival in ([10_000_000, 12, 3, 9_999_999], [9_999_999, 3, 10_000_000, 12]):
        buffer = GroupBuffer()
        for sample in (1, 0):
            for index in arrival:
                group = group_id(index)
                traj = trajectory(group, sample, [0] * (1 + index % 5 + sample))  # lengths differ by group and sample
                buffer.add(f"{group}-{sample}", scored(traj))
        taken = buffer.take_oldest(4)
        assert taken is not None and [g.group_id for g in taken] == [group_id(i) for i in sorted(indices)]
        batch = collate(taken, pad_id=0)
        layouts.append((batch.input_ids, batch.loss_mask, batch.lengths))
    assert all(torch.equal(a, b) for a, b in zip(*layouts, strict=True))


def test_admission_bound() -> None:
    admission = Admission(groups_per_step=4, window=12, max_steps=10)
    assert admission.num_allowed(0) == 12  # (0 + 2 + 1) * 4
    admission.num_admitted, admission.num_dropped = 12, 1
    assert admission.num_allowed(0) == 1 and admission.num_allowed(1) == 5
    admission.num_admitted = 40
    assert admission.num_allowed(50) == 1  # never past max_steps * B live groups


def test_bound_matches_the_architecture_figures() -> None:
    """S* = 1.98 / 2.56 / 2.95 at cv 0.5 / 1 / 2 with rollout at 70% of a sync step (docs/architecture.md, "The
    asynchrony bound")."""
    for cv, expected in ((0.5, 1.98), (1.0, 2.56), (2.0, 2.95)):
        config = TimingEngineConfig(mean_tokens=512, cv=cv, token_time_s=1e-3)
        e_max = expected_max_s(config, 256)
        train = 3 / 7 * e_max
        assert bound(e_max, 0.512, 256, 256, train) == pytest.approx(expected, abs=0.03)


def test_event_model_sync_is_ideal_and_async_gains() -> None:
    config = TimingEngineConfig(mean_tokens=512, cv=1.0, token_time_s=1e-3)
    durations = Durations(config)
    e_max = expected_max_s(config, 64)
    train = 3 / 7 * e_max
    sync = simulate(durations, num_groups=8, group_size=8, num_slots=64, eta=0, train_s=train, num_steps=30)
    assert sync.lags == [0] * len(sync.lags)
    steps = np.diff([0.0, *sync.step_times_s])
    assert steps.mean() == pytest.approx(e_max + train, rel=0.15)  # one longest trajectory plus T + W per step
    fast = simulate(durations, num_groups=8, group_size=8, num_slots=16, eta=2, train_s=train / 0.75, num_steps=30)
    assert fast.throughput(64, 3) > 1.8 * sync.throughput(64, 3)
    assert max(fast.lags) <= 4
