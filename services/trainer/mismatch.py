"""The precision mismatch of a step, measured at the weights that sampled each token, off the step's critical path.

A step's own pass computes pi_prox at the trainer's version, and in an async run almost no token was sampled at it,
so that pass alone measures almost nothing (a coverage of 0.00035 in `make demo`). The sampler keeps the masters of
the last eta_hard + 1 versions and, each step, scores `precision.mismatch.sample` of the batch's rows with the weights
of the version that produced their mu (`scorable_versions`): delta is then numerics, not staleness. One version a
step, so one no-grad pass: the version most of the batch's scorable tokens are at, and among the rows holding tokens
of it, the ceil(sample * B) whose traj_id hashes lowest. The pass runs while the trainer waits for its next groups,
never beside a step (`mismatch_wait_s` is what it adds to that wait), and its figures join the step's metrics.

Memory: eta_hard + 1 copies of the fp32 masters and one scoring model (its masters and their GEMM copies): at the
default eta_hard = 4 about 6x the model's fp32 size, beside the trainer's 4x (masters, gradients, AdamW's moments).
A restarted trainer keeps versions from its own first step on, so for up to eta_hard steps older tokens go
unmeasured, and the coverage says so.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable

import torch

from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.config.precision import MismatchGates
from jetroll.shared.model.model import CausalLM
from jetroll.shared.rl.batch import TokenBatch
from jetroll.shared.rl.mismatch import k3_growth, mismatch_stats, scorable_versions
from jetroll.shared.rl.passes import PolicyPass, policy_width, proximal_pass

log = logging.getLogger("jetroll.trainer")

Measure = Callable[[], dict[str, float]]


def lowest_hashes(traj_ids: list[str], candidates: torch.Tensor, count: int) -> torch.Tensor:
    """bool [B]: the `count` rows among `candidates` (bool [B]) whose traj_id hashes lowest."""
    ranked = sorted(candidates.nonzero().squeeze(-1).tolist(),
                    key=lambda i: hashlib.sha256(traj_ids[i].encode()).digest())
    rows = torch.zeros_like(candidates)
    rows[ranked[:count]] = True
    return rows


class MismatchSampler:
    def __init__(self, model: CausalLM, config: TrainerSections) -> None:
        self.config = config
        # a sync step's tokens are all at the trainer's version, and the step scores every row (actor.py)
        self.share = config.precision.mismatch.sample if config.staleness.mode == "async" else 0.0
        self.eta_hard = config.max_eta_hard
        self.kept_kv = config.rollout_keeps_kv
        self.last_version = config.trainer.max_steps - 1  # the last step's version: no later step scores its tokens
        self.model = model
        self.masters: dict[int, list[torch.Tensor]] = {}
        self.scorer: CausalLM | None = None  # built at its first pass
        self.scorer_version: int | None = None

    def before_step(self, version: int) -> None:
        """Remember the model's weights as `version` for the steps after this one, and forget versions no trained
        token can carry any more."""
        if self.share == 0 or version >= self.last_version:
            return
        self.masters[version] = [param.detach().clone() for param in self.model.parameters()]
        for old in [v for v in self.masters if v < version - self.eta_hard]:
            del self.masters[old]

    def after_step(self, batch: TokenBatch, policy: PolicyPass, version: int) -> Measure:
        """What the step at `version` leaves to measure, as a call that measures it: the scored rows' tokens of that
        version (pi_prox has them), and the sampled rows' tokens of the chosen version, scored when called."""
        prox_logp, scored = policy.prox_logp, policy.scored
        # a drawn log-prob (an engine that runs no model) has no mismatch to measure
        computed = torch.tensor([p in self.config.pools_computing_mu for p in batch.pools], device=scored.device)
        versions = scorable_versions((batch.loss_mask > 0) & computed[:, None], batch.v_tok, self.kept_kv)
        measured = scored[:, None] & (versions == version)
        rows, chosen = torch.zeros_like(scored), None
        if self.share > 0:
            # tokens pi_prox already holds are not the sampler's to score
            candidates = torch.where(measured, -1, versions)
            kept = [v for v in self.masters if v in candidates]
            if kept:
                chosen = max(kept, key=lambda v: (int((candidates == v).sum()), v))
                count = math.ceil(self.share * len(batch.traj_ids))
                rows = lowest_hashes(batch.traj_ids, (candidates == chosen).any(1), count)
        masters = self.masters.get(chosen) if chosen is not None else None

        def measure() -> dict[str, float]:
            started = time.perf_counter()
            trainer_logp, tokens = prox_logp, measured
            if masters is not None and rows.any():
                trainer_logp, tokens = prox_logp.clone(), measured.clone()
                wanted = (versions[rows] == chosen)
                width = policy_width(wanted)
                logp, _ = proximal_pass(self._load(chosen, masters), batch.input_ids[rows, :width],
                                        batch.targets[rows, :width], batch.temperature[rows])
                trainer_logp[rows, :width] = torch.where(wanted[:, :width], logp, trainer_logp[rows, :width])
                tokens[rows] |= wanted
            return self._stats(batch, trainer_logp, tokens) | {"mismatch_sample_s": time.perf_counter() - started}

        return measure

    def _load(self, version: int | None, masters: list[torch.Tensor]) -> CausalLM:
        if self.scorer is None:  # built, not deep-copied: a copy's fused GEMM weights would still read the model's
            model = self.model
            with torch.device(model.lm_head.weight.device):
                self.scorer = CausalLM(model.args, model.precision).requires_grad_(False)
            self.scorer.no_string = model.no_string
            self.scorer.use_unpacked_weights()
        if self.scorer_version != version:
            with torch.no_grad():
                for param, master in zip(self.scorer.parameters(), masters, strict=True):
                    param.copy_(master)
            self.scorer.release_inference_weights()
            self.scorer_version = version
        return self.scorer

    def _stats(self, batch: TokenBatch, trainer_logp: torch.Tensor, measured: torch.Tensor) -> dict[str, float]:
        policy_tokens = batch.loss_mask > 0
        abs_delta = (trainer_logp - batch.behavior_logp).abs()
        delta = abs_delta[measured]
        stats = mismatch_stats(trainer_logp, batch.behavior_logp, measured, self.config.precision.correction_cap)
        # pools may run different engines, each with its own gap to the trainer; tasks differ in output length
        engines = [self.config.pool_engines[p] for p in batch.pools]
        sources = {f"pool/{pool}": [p == pool for p in batch.pools] for pool in sorted(set(batch.pools))}
        sources |= {f"engine/{engine}": [e == engine for e in engines] for engine in sorted(set(engines))}
        sources |= {f"task/{task}": [t == task for t in batch.tasks] for task in sorted(set(batch.tasks))}
        log_ratio = trainer_logp.double() - batch.behavior_logp.double()
        for name, of_source in sources.items():
            rows = torch.tensor(of_source, device=measured.device)[:, None]
            source_delta = abs_delta[measured & rows]
            source_ratio = log_ratio[measured & rows]
            measured_any = source_delta.numel() > 0
            stats[f"mismatch/{name}/abs_mean"] = float(source_delta.mean()) if measured_any else math.nan
            stats[f"mismatch/{name}/k3"] = float((torch.expm1(source_ratio) - source_ratio).mean()) if measured_any \
                else math.nan
            stats[f"mismatch/{name}/coverage"] = float(source_delta.numel() / (policy_tokens & rows).sum().clamp(min=1))
        return stats | {
            "mismatch_abs_sum": float(delta.sum()),
            "mismatch_abs_max": float(delta.max()) if delta.numel() else 0.0,
            "mismatch_tokens": float(measured.sum()),
            "num_policy_tokens": float(policy_tokens.sum()),
            "precision_mismatch": float(delta.mean()) if delta.numel() else math.nan,
            # of every policy token in the batch, measured or not
            "mismatch_coverage": float(measured.sum() / policy_tokens.sum().clamp(min=1)),
        }


class MismatchGateKeeper:
    """`precision.mismatch.gate` over each step's measured mismatch. A restarted trainer starts the growth's window
    again from its own first measured step."""

    def __init__(self, gates: MismatchGates) -> None:
        self.gates = gates
        self.k3s: list[float] = []  # of every measured step, in order

    def check(self, version: int, measured: dict[str, float]) -> tuple[dict[str, float], str | None]:
        """The step's gate metrics (k3's growth, and `mismatch_gate/<gate>` 1.0 for each gate that tripped), and the
        first failing gate's line (None when no `fail` gate tripped); `warn` gates log. A step that measured nothing
        passes every gate."""
        if "mismatch/k3" not in measured:
            return {}, None
        k3, abs_mean = measured["mismatch/k3"], measured["mismatch/abs_mean"]
        self.k3s.append(k3)
        k3_gate = self.gates.k3
        abs_mean_gate = self.gates.abs_mean
        growth_gate = self.gates.growth
        tripped: list[tuple[str, str, str]] = []  # (gate, action, line)
        if k3_gate.above is not None and k3 > k3_gate.above:
            tripped.append(("k3", k3_gate.action, _past("k3", k3, k3_gate.above, version)))
        if abs_mean_gate.above is not None and abs_mean > abs_mean_gate.above:
            tripped.append(("abs_mean", abs_mean_gate.action, _past("abs_mean", abs_mean, abs_mean_gate.above,
                                                                     version)))
        growth = k3_growth(self.k3s, growth_gate.window, growth_gate.floor)
        stats = {} if growth is None else {"mismatch/growth": growth.ratio}
        if (growth is not None and growth_gate.above is not None and growth.latest > growth_gate.floor
                and growth.ratio > growth_gate.above):
            tripped.append(("growth", growth_gate.action,
                            f"mismatch k3 grew {growth.ratio:.3g}x at step {version} (mean {growth.latest:.3g} over "
                            f"the latest {growth.num_latest} measured steps, {growth.baseline:.3g} over the first "
                            f"{growth.num_first}), above precision.mismatch.gate.growth.above = {growth_gate.above:g}"))
        for _, action, line in tripped:
            if action == "warn":
                log.warning("precision mismatch gate: %s", line)
        failures = [line for _, action, line in tripped if action == "fail"]
        return stats | {f"mismatch_gate/{gate}": 1.0 for gate, _, _ in tripped}, next(iter(failures), None)


def _past(name: str, value: float, above: float, version: int) -> str:
    return f"mismatch {name} {value:.3g} at step {version} is above precision.mismatch.gate.{name}.above = {above:g}"
