"""The mismatch of an async step (`precision.mismatch.sample`): rows sampled by older versions are scored with those
versions' weights, through the trainer's real step, so delta is numerics and not staleness."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch
from trainer_harness import RATIOS, events_with_ratios, groups_of, make_trainer, step

from jetroll.services.trainer.mismatch import lowest_hashes
from jetroll.services.trainer.trainer import Trainer
from jetroll.shared.rl.batch import collate
from jetroll.shared.rl.mismatch import scorable_versions

pytestmark = pytest.mark.integration


def step_a_version_later(trainer: Trainer, v_toks: tuple[list[int] | int, ...] | None = None,
                         ratios: tuple[tuple[float, ...], ...] = RATIOS) -> dict[str, float]:
    """Events whose mu is version 0's log-prob minus log(ratio), their tokens at the versions `v_toks` gives (0 by
    default): a step on version-0 events makes version 1, and the next trains these at version 1."""
    events = events_with_ratios(trainer, ratios, v_toks=v_toks)
    step(trainer, groups_of(events_with_ratios(trainer, ratios)))
    trainer.version = 1
    return step(trainer, groups_of(events))


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_the_sampled_share_of_rows_is_scored_at_the_version_that_sampled_it(
    share: float, model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    trainer = make_trainer(model_dir, tmp_path, redis_url, precision={"mismatch": {"sample": share}})
    stats = step_a_version_later(trainer)
    batch = collate(groups_of(events_with_ratios(trainer, RATIOS)), trainer.actor.tokenizer.pad_id)
    # every token is one version behind the trainer, so every row is a candidate
    rows = lowest_hashes(batch.traj_ids, torch.ones(len(RATIOS), dtype=torch.bool), math.ceil(share * len(RATIOS)))
    tokens = (batch.loss_mask > 0) & rows[:, None]
    assert stats["mismatch_coverage"] == float(tokens.sum() / (batch.loss_mask > 0).sum())
    assert stats["mismatch_tokens"] == float(tokens.sum())
    if share == 0:  # no token was sampled at version 1: nothing is measured, and nothing claims to be
        assert math.isnan(stats["precision_mismatch"]) and "mismatch/k3" not in stats
        return
    # version 0's weights give back mu + log(ratio) for each sampled token: the measured gap is the ratios' own
    log_ratios = [abs(math.log(r)) for row in range(len(RATIOS)) if rows[row] for r in RATIOS[row]]
    assert stats["precision_mismatch"] == pytest.approx(sum(log_ratios) / len(log_ratios), rel=1e-4)
    assert stats["mismatch/abs_max"] == pytest.approx(max(log_ratios), rel=1e-4)
    assert stats["mismatch/pool/default/coverage"] == stats["mismatch/engine/jetroll/coverage"] == (
        stats["mismatch_coverage"])
    assert stats["mismatch_sample_s"] > 0


def test_each_task_reports_its_own_mismatch(model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None) -> None:
    """Tasks differ in output length, and so in mismatch: each reports its own k3 and |delta logp| over its rows."""
    trainer = make_trainer(model_dir, tmp_path, redis_url, precision={"mismatch": {"sample": 1.0}},
                           tasks=[{"name": "arithmetic"}, {"name": "count32"}])
    events = events_with_ratios(trainer)  # mu from version 0's weights
    events[4:] = [msgspec.structs.replace(e, trajectory=msgspec.structs.replace(e.trajectory, task="count32"))
                  for e in events[4:]]  # the second group
    step(trainer, groups_of(events_with_ratios(trainer)))
    trainer.version = 1
    stats = step(trainer, groups_of(events))
    for task, rows in (("arithmetic", RATIOS[:4]), ("count32", RATIOS[4:])):
        ratios = [r for row in rows for r in row]
        assert stats[f"mismatch/task/{task}/k3"] == pytest.approx(
            sum(r - 1 - math.log(r) for r in ratios) / len(ratios), rel=1e-4)
        assert stats[f"mismatch/task/{task}/abs_mean"] == pytest.approx(
            sum(abs(math.log(r)) for r in ratios) / len(ratios), rel=1e-4)
        assert stats[f"mismatch/task/{task}/coverage"] == 1.0
    assert stats["mismatch/pool/default/k3"] == pytest.approx(stats["mismatch/k3"], rel=1e-6)


def test_the_exact_backend_reproduces_an_older_versions_fp8_log_probs_bitwise(
    model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    """mu recorded by version 0 on the exact backend, trained at version 1: the kept version-0 masters give every
    token's log-prob back to the bit."""
    trainer = make_trainer(model_dir, tmp_path, redis_url, precision={
        "mode": "fp8_unified", "backend": "exact", "mismatch": {"sample": 1.0}})
    stats = step_a_version_later(trainer, ratios=tuple((1.0,) * len(r) for r in RATIOS))
    assert stats["mismatch_coverage"] == 1.0
    assert stats["mismatch/abs_max"] == stats["mismatch/k3"] == 0.0


def test_with_kept_caches_each_row_is_measured_up_to_its_first_swap(
    model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    trainer = make_trainer(model_dir, tmp_path, redis_url, rollout={"recompute_kv_on_swap": False},
                           precision={"mismatch": {"sample": 1.0}})
    # rows whose tokens swap from version 0 to 1 part-way, and rows that start at version 1
    v_toks = tuple([0] * (len(r) - 1) + [1] if i % 2 else [1] * len(r) for i, r in enumerate(RATIOS))
    stats = step_a_version_later(trainer, v_toks)
    batch = collate(groups_of(events_with_ratios(trainer, RATIOS, v_toks=v_toks)), trainer.actor.tokenizer.pad_id)
    versions = scorable_versions(batch.loss_mask > 0, batch.v_tok, kept_kv=True)
    assert stats["mismatch_tokens"] == float((versions >= 0).sum()) < float((batch.loss_mask > 0).sum())
    # the version-1 tokens after a swap are left out; a row that started at version 1 is pi_prox's or the sampler's
    assert stats["mismatch_tokens"] == float(sum(len(r) - 1 if i % 2 else len(r) for i, r in enumerate(RATIOS)))
    assert math.isfinite(stats["precision_mismatch"])
