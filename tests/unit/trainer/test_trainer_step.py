"""The trainer's real step (`Trainer._step` on a tiny model, the batch assembled as the trainer assembles it): what
the loss's config knobs do to the update it makes."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_harness import (
    CORRECTIONS,
    PROMPTS,
    RATIOS,
    REWARDS,
    events_with_ratios,
    flat_parameters,
    groups_of,
    make_trainer,
    step,
    trajectory,
)

from jetroll.services.trainer.mismatch import lowest_hashes
from jetroll.services.trainer.trainer import Trainer
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.protocol.dead_letters import DeadLetters
from jetroll.shared.protocol.events import Array, GroupEvent
from jetroll.shared.protocol.in_flight import InFlightIndex
from jetroll.shared.protocol.ledger import Ledger, Outcome
from jetroll.shared.protocol.topology import TRAJ_SCORED
from jetroll.shared.rl.batch import PendingGroup, collate
from jetroll.shared.rl.passes import proximal_pass
from jetroll.shared.tasks.registry import TASKS

pytestmark = pytest.mark.integration


def test_every_correction_changes_the_trainers_update(
    model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    """One real step from the same weights on the same batch per `precision.correction`: the masks it reports are
    the correction's, and the five updated weights differ pairwise."""
    events = events_with_ratios(make_trainer(model_dir, tmp_path / "probe", redis_url))
    num_tokens = sum(map(len, RATIOS))
    expected_masked = {  # tokens each correction drops from the loss
        "decoupled": sum(r > 10.0 for rs in RATIOS for r in rs),  # decoupled_band (0, 10)
        "none": 0, "token_tis": 0,
        "seq_mis": sum(len(rs) for rs in RATIOS if math.prod(rs) > 2.0),
        "icepop": sum(not 0.5 <= r <= 2.0 for rs in RATIOS for r in rs),  # icepop_band (0.5, 2)
    }
    start, updated = None, {}
    for kind in CORRECTIONS:
        trainer = make_trainer(model_dir, tmp_path / kind, redis_url, precision={"correction": kind})
        before = flat_parameters(trainer)
        start = before if start is None else start
        assert torch.equal(before, start)
        stats = step(trainer, groups_of(events))
        assert stats["num_tokens"] == num_tokens and stats["grad_rows_frac"] == 1.0
        assert stats["is_ratio_max"] == pytest.approx(20.0, rel=1e-4)  # the ratios reached the loss
        assert stats["band_masked_tokens"] == expected_masked[kind], kind
        updated[kind] = flat_parameters(trainer) - start
        assert updated[kind].abs().max() > 0, kind
    for a, b in itertools.combinations(CORRECTIONS, 2):
        gap = float((updated[a] - updated[b]).norm() / updated[a].norm())
        assert gap > 0.05, f"{a} and {b} give updates only {gap:.3f} apart"


@pytest.mark.parametrize("cap", [None, 4])
def test_dr_grpo_divides_by_batch_times_max_new_tokens(
    cap: int | None, model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    """On policy (pi_theta = pi_prox = mu) every token's loss is -A, so the step's loss is -sum(A x length) / D: D is
    batch x max_new_tokens (arithmetic asks for 8; rollout.max_new_tokens caps it), not batch x padded width."""
    sections: dict[str, Any] = {"trainer": {"group_size": 4, "advantage": "dr_grpo"}}
    if cap is not None:
        sections["rollout"] = {"max_new_tokens": cap}
    trainer = make_trainer(model_dir, tmp_path, redis_url, **sections)
    on_policy = tuple(tuple(1.0 for _ in row) for row in RATIOS)
    groups = groups_of(events_with_ratios(trainer, on_policy))
    stats = step(trainer, groups)
    advantages = [r - sum(rewards) / len(rewards) for rewards in REWARDS for r in rewards]
    summed = sum(a * len(row) for a, row in zip(advantages, RATIOS, strict=True))
    own = TASKS["arithmetic"].max_new_tokens
    budget = own if cap is None else min(own, cap)
    assert summed != 0 and budget == trainer.config.sample_budgets["arithmetic"]
    width = collate(groups, trainer.actor.tokenizer.pad_id).loss_mask.shape[1]
    assert width != budget  # the padded width would give another loss
    assert stats["loss"] == pytest.approx(-summed / (len(RATIOS) * budget), rel=1e-4)


@pytest.mark.parametrize(("backend", "mode"), [("fast", "async"), ("fast", "sync"), ("exact", "async")])
def test_step_reports_the_token_entropy_of_pi_prox(
    backend: str, mode: str, model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    """`entropy` is the mean of H(softmax(logits / T)) at the step's start over the policy tokens of the rows the step
    scores: on `fast` in async mode the gradient rows only (a zero-advantage group gets no pass at all), in sync mode
    and on `exact` every row (a no-grad pass, or the exact pi_prox pass, covers them)."""
    trainer = make_trainer(model_dir, tmp_path, redis_url, precision={"backend": backend}, staleness={"mode": mode})
    rewards = (REWARDS[0], (1.0, 1.0, 1.0, 1.0))  # the second group has no signal
    groups = groups_of(events_with_ratios(trainer, RATIOS, rewards))
    batch = collate(groups, trainer.actor.tokenizer.pad_id)
    _, entropy = proximal_pass(trainer.actor.model, batch.input_ids, batch.targets, batch.temperature)
    stats = step(trainer, groups)
    assert stats["grad_rows_frac"] == 0.5
    policy_tokens = batch.loss_mask > 0
    everything = backend == "exact" or mode == "sync"
    scored = policy_tokens if everything else policy_tokens & (torch.arange(len(batch.input_ids)) < 4)[:, None]
    expected = float(entropy[scored].mean())
    assert 0 < expected <= math.log(trainer.actor.model.args.vocab_size)
    if not everything:  # the two rules differ on this batch
        assert expected != pytest.approx(float(entropy[policy_tokens].mean()), rel=1e-4)
    assert stats["entropy"] == pytest.approx(expected, rel=1e-5)
    assert stats["num_policy_tokens"] == float(policy_tokens.sum())
    # every token is at the trainer's version: the mismatch measures the scored ones and, in async mode, those of the
    # rows `precision.mismatch.sample` picks among the others
    if mode == "async":
        others = ~scored.any(1)
        count = math.ceil(trainer.config.precision.mismatch.sample * len(others))
        scored = scored | (policy_tokens & lowest_hashes(batch.traj_ids, others, count)[:, None])
    assert stats["mismatch_tokens"] == float(scored.sum())


@pytest.mark.parametrize("backend", ["fast", "exact"])
def test_entropy_bonus_raises_the_entropy_the_step_leaves(
    backend: str, model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    """`trainer.entropy_coef`: one real step from the same weights on the same batch, with and without the bonus.
    The updates differ, and the policy after the bonus's step has the higher token entropy on the batch."""
    events = events_with_ratios(make_trainer(model_dir, tmp_path / "probe", redis_url))
    entropy_after, updated = {}, {}
    for coef in (0.0, 1.0):
        trainer = make_trainer(model_dir, tmp_path / f"coef{coef}", redis_url,
                               trainer={"entropy_coef": coef}, precision={"backend": backend})
        before = flat_parameters(trainer)
        groups = groups_of(events)
        step(trainer, groups)
        updated[coef] = flat_parameters(trainer) - before
        batch = collate(groups, trainer.actor.tokenizer.pad_id)
        _, entropy = proximal_pass(trainer.actor.model, batch.input_ids, batch.targets, batch.temperature)
        entropy_after[coef] = float(entropy[batch.loss_mask > 0].mean())
    assert float((updated[1.0] - updated[0.0]).norm() / updated[0.0].norm()) > 0.05
    assert entropy_after[1.0] > entropy_after[0.0]


@pytest.mark.parametrize("invalid_sample", [3, 1], ids=["missing-sample", "copy-of-a-held-sample"])
def test_a_group_whose_missing_sample_is_invalid_is_dropped(
    invalid_sample: int, model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    """Samples 0-2 of an in-flight group arrive valid and one copy of sample `invalid_sample` arrives with NaN
    log-probs. When that was the missing sample, the group can never complete (the eta_hard wait would wait on it
    for good), so the trainer records it `dropped:invalid` and acks its entries; an invalid copy of a sample it
    already holds is only dead-lettered."""
    trainer = make_trainer(model_dir, tmp_path, redis_url)
    job = trainer.config.job_id
    tokenizer = build_char_tokenizer()

    async def body() -> tuple[dict, list, int]:
        await trainer.bus.ensure_group(TRAJ_SCORED.name, TRAJ_SCORED.group)
        admitted = GroupEvent(job_id=job, group_id="g0", task="arithmetic", pool="default", prompt=PROMPTS[0],
                              prompt_ids=Array.of(tokenizer.encode(PROMPTS[0]), "<i4"), answer="0", group_size=4,
                              max_new_tokens=8, v_adm=0)
        await InFlightIndex(trainer.bus).admit([admitted], num_admitted=0, num_indices=1)
        completion = tokenizer.encode("46")
        for sample in range(3):
            await trainer.bus.publish(TRAJ_SCORED.name, trajectory(job, sample, completion, [-0.5, -0.5]))
        bad = trajectory(job, invalid_sample, completion, [float("nan"), -0.5])
        await trainer.bus.publish(TRAJ_SCORED.name, bad)
        for _ in range(3):
            await trainer.intake.read()
        outcomes = await Ledger(trainer.bus).outcomes()
        lag = await trainer.bus.lag(TRAJ_SCORED.name, TRAJ_SCORED.group)
        dlq = await DeadLetters(trainer.bus).read()
        await trainer.bus.close()
        return outcomes, dlq, lag

    outcomes, dlq, lag = asyncio.run(body())
    assert len(dlq) == 1 and "behavior_logprobs" in dlq[0]["reason"]
    if invalid_sample == 3:
        assert outcomes["g0"] == Outcome(0, "dropped:invalid", 3) and lag == 0
        assert "g0" not in trainer.intake.buffer.groups
    else:
        assert outcomes == {} and lag == 3  # the three held samples stay pending until their group trains
        assert len(trainer.intake.buffer.groups["g0"].samples) == 3


def test_updates_per_batch_takes_that_many_clipped_updates_on_one_batch(
    model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None
) -> None:
    """`trainer.updates_per_batch`: from the same weights on the same on-policy batch, 1 and 3 optimizer updates at lr
    3e-4. Adam counts 3 steps; the first update of each is on policy (ratio 1, nothing clipped) and the third
    moves the ratio past the clip; and the three updates raise the advantage-weighted log-likelihood of the batch
    more than one does."""
    on_policy = tuple(tuple(1.0 for _ in row) for row in RATIOS)
    events = events_with_ratios(make_trainer(model_dir, tmp_path / "probe", redis_url), on_policy)
    advantages = torch.tensor([r - sum(rewards) / len(rewards) for rewards in REWARDS for r in rewards])
    gain, stats = {}, {}
    for updates in (1, 3):
        trainer = make_trainer(model_dir, tmp_path / f"u{updates}", redis_url,
                               trainer={"updates_per_batch": updates, "lr": 3e-4})
        groups = groups_of(events)
        before = _weighted_logp(trainer, groups, advantages)
        stats[updates] = step(trainer, groups)
        gain[updates] = _weighted_logp(trainer, groups, advantages) - before
        adam_steps = {int(state["step"]) for state in trainer.actor.optimizer.state.values()}
        assert adam_steps == {updates}
    assert stats[1]["clip_frac"] == 0.0 < stats[3]["clip_frac"]
    assert gain[3] > gain[1] > 0


def _weighted_logp(trainer: Trainer, groups: list[PendingGroup], advantages: torch.Tensor) -> float:
    """sum over rows of advantage x the row's log-likelihood under the trainer's current weights."""
    batch = collate(groups, trainer.actor.tokenizer.pad_id)
    logp, _ = proximal_pass(trainer.actor.model, batch.input_ids, batch.targets, batch.temperature)
    return float(((logp * batch.loss_mask).sum(1) * advantages).sum())
