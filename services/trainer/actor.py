"""The actor: the policy, its optimizer and the KL reference, and one optimizer step on a batch of groups."""

from __future__ import annotations

from typing import NamedTuple

import torch

from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.model.checkpoint import load_pretrained, torch_device
from jetroll.shared.model.model import CausalLM
from jetroll.shared.rl.batch import PendingGroup, TokenBatch, collate
from jetroll.shared.rl.loss import group_advantages, loss_denominator, ppo_loss
from jetroll.shared.rl.passes import PolicyPass, gradient_logp, gradient_rows, policy_pass, reference_logp
from jetroll.shared.rl.schedule import trainer_lr
from jetroll.shared.rl.staleness import fresh_tokens


class Stepped(NamedTuple):
    """What one step computed: its stats, its batch and its passes (the after-step hooks read the last two)."""

    stats: dict[str, float]
    batch: TokenBatch
    policy: PolicyPass


class Actor:
    def __init__(self, config: TrainerSections) -> None:
        assert config.model.path, "the launcher resolves model.path before services start"
        self.config = config
        self.device = torch_device(config.trainer.device, "trainer.device")
        numerics = config.precision.numerics().trainer_side()
        self.model, self.tokenizer = load_pretrained(config.model.path, numerics, self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.trainer.lr,
                                           weight_decay=config.trainer.weight_decay)
        self.reference: CausalLM | None = None
        if config.trainer.kl_coef > 0:
            self.reference, _ = load_pretrained(config.model.path, numerics, self.device)
            self.reference.requires_grad_(False)
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
                             score_all=self.config.staleness.mode == "sync")
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
                    logp, row_entropy = gradient_logp(self.model, batch, rows, width, self.tokenizer.pad_id)
                    row_entropy = row_entropy if cfg.entropy_coef > 0 else None
                loss, loss_stats = ppo_loss(logp, prox_logp, behavior_logp, advantages[rows], loss_mask[rows, :width],
                                            cfg, denominator=denominator, ref_logp=ref_logp,
                                            correction=self.config.precision, entropy=row_entropy)
                # the last update's figures: its clip_frac says how far the updates moved from pi_prox
                loss_stats |= self._optimizer_step(loss, stats["lr"])
            stats |= loss_stats
        return Stepped(stats | self._batch_stats(batch, policy), batch, policy)

    def lr(self, version: int) -> float:
        """The learning rate of the step that makes `version + 1`: a pure function of the version, so a resumed run
        picks the schedule up."""
        return trainer_lr(self.config.trainer, version)

    def _loss_denominator(self, batch: TokenBatch, loss_mask: torch.Tensor) -> float:
        budgets = [self.config.sample_budgets[task] for task in batch.tasks]
        return loss_denominator(self.config.trainer.advantage, loss_mask, budgets)

    def _reference_logp(self, batch: TokenBatch, rows: torch.Tensor, width: int) -> torch.Tensor | None:
        if self.reference is None:
            return None
        return reference_logp(self.reference, batch, rows, width, self.tokenizer.pad_id)

    def _optimizer_step(self, loss: torch.Tensor, lr: float) -> dict[str, float]:
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.trainer.grad_clip))
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # the staging that follows needs the room more than the next step
        return {"grad_norm": grad_norm}

    def _batch_stats(self, batch: TokenBatch, policy: PolicyPass) -> dict[str, float]:
        # the policy tokens of the rows the step scored: the gradient rows (every row on the exact backend)
        mask = (batch.loss_mask > 0) & policy.scored[:, None]
        entropy = float(policy.entropy[mask].mean()) if mask.any() else float("nan")  # of pi_prox, the step's start
        return {"entropy": entropy} | _task_stats(batch)


def _task_stats(batch: TokenBatch) -> dict[str, float]:
    rewards = batch.rewards.flatten().tolist()
    stats: dict[str, float] = {"reward_mean": sum(rewards) / len(rewards)}
    for task in sorted(set(batch.tasks)):
        rows = [i for i, t in enumerate(batch.tasks) if t == task]
        stats[f"reward/{task}"] = sum(rewards[i] for i in rows) / len(rows)
        stats[f"accuracy/{task}"] = sum(batch.is_correct[i] for i in rows) / len(rows)
    return stats
