"""The trainer's per-step training-inference mismatch metrics, overall and by position, and the loss's corrections."""

from __future__ import annotations

import math

import pytest
import torch

from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.rl.loss import behavior_correction
from jetroll.shared.rl.mismatch import mismatch_stats, scorable_versions


def test_mismatch_stats_on_known_deltas() -> None:
    rollout = torch.zeros(2, 300)
    trainer = torch.zeros(2, 300)
    mask = torch.zeros(2, 300, dtype=torch.bool)
    mask[0, 10:14] = True  # four tokens of sequence 0 at positions 10..13
    trainer[0, 10:14] = torch.tensor([0.5, -0.5, 1.0, 0.0])
    mask[1, 200] = mask[1, 290] = True  # two tokens of sequence 1, in later buckets
    trainer[1, 200], trainer[1, 290] = -1.0, 0.25
    trainer[1, 5] = 9.0  # outside the mask: ignored
    stats = mismatch_stats(trainer, rollout, mask, tis_cap=2.0)
    deltas = torch.tensor([0.5, -0.5, 1.0, 0.0, -1.0, 0.25], dtype=torch.float64)
    assert stats["mismatch/tokens"] == 6
    assert stats["mismatch/abs_mean"] == pytest.approx(3.25 / 6)
    assert stats["mismatch/abs_max"] == 1.0
    assert stats["mismatch/k3"] == pytest.approx(float((deltas.exp() - 1 - deltas).mean()))
    assert stats["mismatch/exp_abs_mean"] == pytest.approx(math.exp(3.25 / 6))
    assert stats["mismatch/seq_delta_abs_mean"] == pytest.approx((1.0 + 0.75) / 2)
    assert stats["mismatch/tis_clip_frac"] == pytest.approx(1 / 6)  # e^1 > 2
    assert stats["mismatch/tokens@0-127"] == 4 and stats["mismatch/abs_max@0-127"] == 1.0
    assert stats["mismatch/tokens@128-255"] == 1 and stats["mismatch/abs_mean@128-255"] == 1.0
    assert stats["mismatch/tokens@256-511"] == 1 and stats["mismatch/k3@256-511"] == pytest.approx(
        math.expm1(0.25) - 0.25)
    assert not any("@512" in key for key in stats)


def test_no_tokens_no_stats_and_equal_logprobs_are_zero() -> None:
    logp = torch.randn(3, 40)
    assert mismatch_stats(logp, logp, torch.zeros(3, 40, dtype=torch.bool)) == {}
    stats = mismatch_stats(logp, logp.clone(), torch.ones(3, 40, dtype=torch.bool))
    assert stats["mismatch/abs_max"] == 0 and stats["mismatch/k3"] == 0 and stats["mismatch/exp_abs_mean"] == 1
    assert stats["mismatch/tokens@0-127"] == 120


def test_scorable_versions_with_kept_kv_end_at_the_first_swap() -> None:
    # row 0: prompt (mask 0), then tokens at versions 4 4 5 5; row 1: 5 5, an observation at 5 (mask 0), then 5
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 1]]).bool()
    v_tok = torch.tensor([[0, 4, 4, 5, 5], [0, 5, 5, 5, 5]])
    assert scorable_versions(mask, v_tok, kept_kv=False).tolist() == [[-1, 4, 4, 5, 5], [-1, 5, 5, -1, 5]]
    # row 0's version-5 tokens were computed over keys version 4 wrote: no one version's pass gives their log-probs
    assert scorable_versions(mask, v_tok, kept_kv=True).tolist() == [[-1, 4, 4, -1, -1], [-1, 5, 5, -1, 5]]
    # an observation written at an older version ends the segment too
    v_tok[1, 3] = 4
    assert scorable_versions(mask, v_tok, kept_kv=True).tolist()[1] == [-1, 5, 5, -1, -1]
    # a row without policy tokens has none
    assert scorable_versions(torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.long),
                             kept_kv=True).tolist() == [[-1, -1, -1]]


def test_behavior_corrections() -> None:
    """r = pi_prox / mu per token; sequence 0 has r = (3, 1, 0.4), sequence 1 has r = (1.5, 1.2) and a pad."""
    prox = torch.log(torch.tensor([[3.0, 1.0, 0.4], [1.5, 1.2, 7.0]]))
    mu = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])

    def run(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        weight, keep = behavior_correction(prox, mu, mask, PrecisionConfig(correction=kind))
        return weight * mask, keep * mask

    assert PrecisionConfig().correction == "decoupled"
    assert torch.allclose(run("decoupled")[0], torch.tensor([[2.0, 1.0, 0.4], [1.5, 1.2, 0.0]]))
    narrow = behavior_correction(prox, mu, mask, PrecisionConfig(decoupled_band=(0.5, 2.5), correction_cap=1.5))
    assert torch.allclose(narrow[0] * mask, torch.tensor([[1.5, 1.0, 0.4], [1.5, 1.2, 0.0]]))  # one C for all
    assert torch.equal(narrow[1] * mask, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    assert torch.equal(run("none")[0], mask) and torch.equal(run("none")[1], mask)
    assert torch.allclose(run("token_tis")[0], torch.tensor([[2.0, 1.0, 0.4], [1.5, 1.2, 0.0]]))
    weight, keep = run("icepop")  # band [0.5, 2]: 3 and 0.4 are masked
    assert torch.equal(keep, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    assert torch.allclose(weight, torch.tensor([[3.0, 1.0, 0.4], [1.5, 1.2, 0.0]]))
    weight, keep = run("seq_mis")  # sequence ratios 1.2 (kept, pad excluded) and 1.8 (kept); cap 2
    assert torch.allclose(weight, torch.tensor([[1.2, 1.2, 1.2], [1.8, 1.8, 0.0]]))
    assert torch.equal(keep, mask)
    capped = behavior_correction(prox, mu, mask, PrecisionConfig(correction="seq_mis", correction_cap=1.5))
    assert capped[1][:, 0].tolist() == [1.0, 0.0]  # 1.8 > 1.5: the whole sequence is masked


def test_correction_is_not_part_of_the_precision_id() -> None:
    loss_only = PrecisionConfig(correction="icepop", correction_cap=3.0, decoupled_band=(0.1, 5.0))
    assert loss_only.precision_id("plan") == PrecisionConfig().precision_id("plan")
    assert PrecisionConfig(mismatch={"sample": 1.0}).precision_id("plan") == PrecisionConfig().precision_id("plan")
    with pytest.raises(ValueError, match="icepop_band"):
        PrecisionConfig(icepop_band=(2.0, 0.5))
    with pytest.raises(ValueError, match="decoupled_band"):
        PrecisionConfig(decoupled_band=(1.0, 1.0))
