"""The precision mismatch of an async run: a share of every batch's rows scored at the versions that sampled them.

A step's own pass computes pi_prox at the trainer's version, and in an async run almost no token was sampled at it,
so that pass alone measures almost nothing (a coverage of 0.00035 in `make demo`). The sampler keeps the masters of
the last eta_hard + 1 versions and scores `precision.mismatch.sample` of each batch's rows, chosen by a hash of their
traj_id, with the weights of the version that produced each token's mu (`scorable_versions`): the delta is then
numerics, not staleness. It holds eta_hard + 1 copies of the fp32 masters and one scoring model (its masters and,
in the FP8 modes, their rounded copies): at eta_hard = 4, about 6x the model's fp32 size, beside the trainer's 4x
(masters, gradients, AdamW's two moments). A restarted trainer keeps versions from its own first step on, so for up to
eta_hard steps the older tokens go unmeasured, and the coverage says so.
"""

from __future__ import annotations

import hashlib
import math

import torch

from jetroll.services.trainer.passes import policy_width, proximal_pass
from jetroll.shared.config.job import JobConfig
from jetroll.shared.model.model import CausalLM
from jetroll.shared.rl.batch import TokenBatch
from jetroll.shared.rl.mismatch import scorable_versions


def sampled_rows(traj_ids: list[str], share: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [B]: the ceil(share * B) rows whose traj_id hashes lowest; a row's chance does not depend on its batch."""
    count = math.ceil(share * len(traj_ids))
    ranked = sorted(range(len(traj_ids)), key=lambda i: hashlib.sha256(traj_ids[i].encode()).digest())
    rows = torch.zeros(len(traj_ids), dtype=torch.bool, device=device)
    rows[ranked[:count]] = True
    return rows


class MismatchSampler:
    def __init__(self, model: CausalLM, config: JobConfig) -> None:
        # a sync step's tokens are all at the trainer's version, and the step scores every row (actor.py)
        self.share = config.precision.mismatch.sample if config.staleness.mode == "async" else 0.0
        self.eta_hard = config.staleness.eta_hard
        self.kept_kv = not config.rollout.recompute_kv_on_swap
        self.masters: dict[int, list[torch.Tensor]] = {}
        self.scorer: CausalLM | None = None
        if self.share > 0:  # built, not deep-copied: a copy's fused GEMM weights would still read the model's linears
            self.scorer = CausalLM(model.args, model.precision).to(model.lm_head.weight.device).requires_grad_(False)
            self.scorer.no_string = model.no_string
        self.scorer_version: int | None = None

    def keep(self, version: int, model: CausalLM) -> None:
        """Remember `model`'s weights as `version`, and forget versions no trained token can carry any more."""
        if self.scorer is None:
            return
        self.masters[version] = [param.detach().clone() for param in model.parameters()]
        for old in [v for v in self.masters if v < version - self.eta_hard]:
            del self.masters[old]

    def measure(self, batch: TokenBatch, prox_logp: torch.Tensor, scored: torch.Tensor,
                version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's log-probs [B, T] and the tokens they measure (bool [B, T]): the scored rows' tokens of the
        trainer's `version`, from pi_prox at no cost, and the sampled rows' tokens of every version still kept."""
        versions = scorable_versions(batch.loss_mask > 0, batch.v_tok, self.kept_kv)
        measured = scored[:, None] & (versions == version)
        if self.scorer is None:
            return prox_logp, measured
        trainer_logp = prox_logp.clone()
        sampled = sampled_rows(batch.traj_ids, self.share, versions.device)
        for kept in sorted(set(versions[sampled].unique().tolist()) & set(self.masters)):
            rows = sampled & (versions == kept).any(1)
            if kept == version:
                rows &= ~scored  # pi_prox has these already
            if not rows.any():
                continue
            tokens = versions[rows] == kept
            width = policy_width(tokens)
            logp, _ = proximal_pass(self._load(kept), batch.input_ids[rows, :width], batch.targets[rows, :width],
                                    batch.temperature[rows])
            trainer_logp[rows, :width] = torch.where(tokens[:, :width], logp, trainer_logp[rows, :width])
            measured[rows] |= tokens
        return trainer_logp, measured

    def _load(self, version: int) -> CausalLM:
        assert self.scorer is not None
        if self.scorer_version != version:
            with torch.no_grad():
                for param, master in zip(self.scorer.parameters(), self.masters[version], strict=True):
                    param.copy_(master)
            self.scorer.release_inference_weights()
            self.scorer_version = version
        return self.scorer
