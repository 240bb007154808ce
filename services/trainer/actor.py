"""The actor: the policy, its optimizer and the KL reference, and one optimizer step on a batch of groups."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.model.checkpoint import load_pretrained, torch_device
from jetroll.shared.model.model import CausalLM
from jetroll.shared.rl.batch import PendingGroup, TokenBatch, collate
from jetroll.shared.rl.loss import group_advantages, loss_denominator, ppo_loss
from jetroll.shared.rl.passes import PolicyPass, gradient_logp, gradient_rows, policy_pass, reference_logp
from jetroll.shared.rl.ranks import ONE_RANK, Ranks, shard_model
from jetroll.shared.rl.schedule import trainer_lr
from jetroll.shared.rl.staleness import fresh_tokens


class Stepped(NamedTuple):
    """What one step computed: its stats, its batch and its passes (the after-step hooks read the last two)."""

    stats: dict[str, float]
    batch: TokenBatch
    policy: PolicyPass


# how a step's figures combine over ranks (tuples: every rank reduces them in one order): most are means, weighted by
# each rank's policy tokens (its rows for grad_rows_frac, its scored tokens for entropy); these add up, these are
# maxima, and these are the same on every rank already
SUMS = ("loss", "num_tokens", "band_masked_tokens")
MAXIMA = ("is_weight_max", "is_ratio_max")
SAME_ON_EVERY_RANK = ("lr", "grad_norm")


def trainer_device(spec: str, ranks: int) -> torch.device:
    """The device a rank trains on: `trainer.device`, and at N ranks on CUDA the local rank's GPU (torchrun's
    LOCAL_RANK)."""
    device = torch_device(spec, "trainer.device")
    if device.type == "cuda" and ranks > 1 and device.index is None:
        device = torch_device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}", "trainer.device")
    return device


class Actor:
    def __init__(self, config: TrainerSections, ranks: Ranks = ONE_RANK) -> None:
        """At N ranks the policy (and the KL reference) is sharded with FSDP2 after its load: every rank loads the
        same base, so the shards need no broadcast."""
        assert config.model.path, "the launcher resolves model.path before services start"
        self.config = config
        self.ranks = ranks
        self.device = trainer_device(config.trainer.device, ranks.world_size)
        numerics = config.precision.numerics().trainer_side()
        self.model, self.tokenizer = load_pretrained(config.model.path, numerics, self.device)
        self.model.train()
        if ranks.is_sharded:
            shard_model(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.trainer.lr,
                                           weight_decay=config.trainer.weight_decay)
        self.reference: CausalLM | None = None
        if config.trainer.kl_coef > 0:
            self.reference, _ = load_pretrained(config.model.path, numerics, self.device)
            self.reference.requires_grad_(False)
            if ranks.is_sharded:  # FSDP2 parameters cannot become views of another tensor
                shard_model(self.reference)
            else:
                self.reference.share_inference_masters()

    def step(self, groups: list[PendingGroup], version: int) -> Stepped:
        """batch -> pi_prox -> advantages -> the corrected PPO loss -> `updates_per_batch` optimizer steps, at the
        trainer's `version` (the caller publishes)."""
        cfg = self.config.trainer
        batch = collate(groups, self.tokenizer.pad_id, self.device)
        # a group whose rewards are all equal has zero advantage, so its tokens add nothing to the PPO gradient: they
        # get no pass of their own in async mode (passes.py), unless a KL term gives them a gradient
        with_grad = gradient_rows(batch.rewards, has_kl=self.reference is not None)
        self.optimizer.zero_grad(set_to_none=True)
        # a sync step's tokens are all of one version, so every row's mismatch is measurable: score them all
        policy = policy_pass(self.model, batch, with_grad, self.tokenizer.pad_id, entropy_grad=cfg.entropy_coef > 0,
                             score_all=self.config.staleness.mode == "sync", ranks=self.ranks)
        advantages = group_advantages(batch.rewards, cfg.advantage).flatten()
        eta_hard = torch.tensor([self.config.eta_hard[task] for task in batch.tasks], device=self.device)
        loss_mask = fresh_tokens(batch.loss_mask, batch.v_tok, version, eta_hard[:, None])
        stats: dict[str, float] = {"grad_rows_frac": float(with_grad.float().mean()), "lr": self.lr(version)}
        if policy.logp is not None:  # with no signal at all there is nothing to step on (not even Adam's momentum)
            rows, width = policy.rows, policy.width
            prox_logp, behavior_logp = policy.prox_logp[rows, :width], batch.behavior_logp[rows, :width]
            denominator = self._loss_denominator(batch, loss_mask)
            ref_logp = self._reference_logp(batch, rows, width)
            logp, row_entropy = policy.logp, policy.row_entropy
            for update in range(cfg.updates_per_batch):
                if update:  # the same rows again, at the weights the last update left
                    logp, row_entropy = gradient_logp(self.model, batch, rows, width, self.tokenizer.pad_id,
                                                      self.ranks)
                    row_entropy = row_entropy if cfg.entropy_coef > 0 else None
                loss, loss_stats = ppo_loss(logp, prox_logp, behavior_logp, advantages[rows], loss_mask[rows, :width],
                                            cfg, denominator=denominator, ref_logp=ref_logp,
                                            correction=self.config.precision, entropy=row_entropy)
                # the last update's figures: its clip_frac says how far the updates moved from pi_prox
                loss_stats |= self._optimizer_step(loss, stats["lr"])
            stats |= loss_stats
        stats |= self._batch_stats(batch, policy)
        # sharded, a share's reward and accuracy are not the step's: rank 0 holds every group, and reports those
        stats = self._reduced(stats, batch, policy) if self.ranks.is_sharded else stats | _task_stats(batch)
        return Stepped(stats, batch, policy)

    def lr(self, version: int) -> float:
        """The learning rate of the step that makes `version + 1`: a pure function of the version, so a resumed run
        picks the schedule up."""
        return trainer_lr(self.config.trainer, version)

    def _loss_denominator(self, batch: TokenBatch, loss_mask: torch.Tensor) -> float:
        budgets = [self.config.sample_budgets[task] for task in batch.tasks]
        return loss_denominator(self.config.trainer.advantage, loss_mask, budgets, self.ranks)

    def _reference_logp(self, batch: TokenBatch, rows: torch.Tensor, width: int) -> torch.Tensor | None:
        if self.reference is None:
            return None
        return reference_logp(self.reference, batch, rows, width, self.tokenizer.pad_id, self.ranks)

    def _optimizer_step(self, loss: torch.Tensor, lr: float) -> dict[str, float]:
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.trainer.grad_clip))
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self.optimizer.step()
        self.model.mark_weights_changed()
        self.optimizer.zero_grad(set_to_none=True)  # the staging that follows needs the room more than the next step
        return {"grad_norm": grad_norm}

    def _batch_stats(self, batch: TokenBatch, policy: PolicyPass) -> dict[str, float]:
        # the policy tokens of the rows the step scored: the gradient rows (every row on the exact backend)
        mask = (batch.loss_mask > 0) & policy.scored[:, None]
        entropy = float(policy.entropy[mask].mean()) if mask.any() else float("nan")  # of pi_prox, the step's start
        return {"entropy": entropy}

    def _reduced(self, stats: dict[str, float], batch: TokenBatch, policy: PolicyPass) -> dict[str, float]:
        """The whole step's figures from each rank's: every rank has the same names, so the reductions line up."""
        scored_tokens = float(((batch.loss_mask > 0) & policy.scored[:, None]).sum())
        weight_of = {"grad_rows_frac": float(len(batch.traj_ids)), "entropy": scored_tokens}
        sums = [name for name in SUMS if name in stats]
        maxima = [name for name in MAXIMA if name in stats]
        means = [name for name in stats if name not in (*sums, *maxima, *SAME_ON_EVERY_RANK)]
        weights = [weight_of.get(name, stats.get("num_tokens", 0.0)) for name in means]
        # a rank with no token of a mean adds nothing to it (its own figure is nan or 0)
        weighted = [stats[name] * weight if weight else 0.0 for name, weight in zip(means, weights, strict=True)]
        totals = self.ranks.reduce([*weighted, *weights, *(stats[name] for name in sums)])
        reduced = dict(stats)
        for i, name in enumerate(means):
            total_weight = totals[len(means) + i]
            reduced[name] = totals[i] / total_weight if total_weight else float("nan")
        reduced.update(zip(sums, totals[2 * len(means):], strict=True))
        reduced.update(zip(maxima, self.ranks.reduce([stats[name] for name in maxima], "max"), strict=True))
        return reduced


def _task_stats(batch: TokenBatch) -> dict[str, float]:
    rewards = batch.rewards.flatten().tolist()
    stats: dict[str, float] = {"reward_mean": sum(rewards) / len(rewards)}
    for task in sorted(set(batch.tasks)):
        rows = [i for i, t in enumerate(batch.tasks) if t == task]
        stats[f"reward/{task}"] = sum(rewards[i] for i in rows) / len(rows)
        stats[f"accuracy/{task}"] = sum(batch.is_correct[i] for i in rows) / len(rows)
    return stats
