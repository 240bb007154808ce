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

from jetroll.services.trainer.passes import policy_width, proximal_pass
from jetroll.shared.config.job import JobConfig
from jetroll.shared.config.precision import MismatchGates
from jetroll.shared.model.model import CausalLM
from jetroll.shared.rl.batch import TokenBatch
from jetroll.shared.rl.mismatch import mismatch_stats, scorable_versions

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
    def __init__(self, model: CausalLM, config: JobConfig) -> None:
        self.config = config
        # a sync step's tokens are all at the trainer's version, and the step scores every row (actor.py)
        self.share = config.precision.mismatch.sample if config.staleness.mode == "async" else 0.0
        self.eta_hard = config.staleness.eta_hard
        self.kept_kv = not config.rollout.recompute_kv_on_swap
        self.last_version = config.trainer.max_steps - 1  # the last step's version: no later step scores its tokens
        self.model = model
        self.masters: dict[int, list[torch.Tensor]] = {}
        self.scorer: CausalLM | None = None  # built at its first pass
        self.scorer_version: int | None = None

    def keep(self, version: int, model: CausalLM) -> None:
        """Remember `model`'s weights as `version` for the steps after this one, and forget versions no trained token
        can carry any more."""
        if self.share == 0 or version >= self.last_version:
            return
        self.masters[version] = [param.detach().clone() for param in model.parameters()]
        for old in [v for v in self.masters if v < version - self.eta_hard]:
            del self.masters[old]

    def prepare(self, batch: TokenBatch, prox_logp: torch.Tensor, scored: torch.Tensor, version: int) -> Measure:
        """What the step leaves to measure, as a call that measures it: the scored rows' tokens of the trainer's
        `version` (pi_prox has them), and the sampled rows' tokens of the chosen version, scored when called."""
        rollout = self.config.rollout
        # the timing model's log-probs are drawn, not computed: its rows have no mismatch to measure
        computed = torch.tensor([rollout.engine_of(rollout.pool(p)) != "timing" for p in batch.pools],
                                device=scored.device)
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
        # pools may run different engines: each has its own gap to the trainer
        rollout = self.config.rollout
        sources = {f"pool/{pool}": [p == pool for p in batch.pools] for pool in sorted(set(batch.pools))}
        for engine in sorted({rollout.engine_of(rollout.pool(pool)) for pool in batch.pools}):
            sources[f"engine/{engine}"] = [rollout.engine_of(rollout.pool(p)) == engine for p in batch.pools]
        for name, of_source in sources.items():
            rows = torch.tensor(of_source, device=measured.device)[:, None]
            source_delta = abs_delta[measured & rows]
            stats[f"mismatch/{name}/abs_mean"] = float(source_delta.mean()) if source_delta.numel() else math.nan
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
        """The step's gate metrics, and the first failing gate's line (None when no `fail` gate tripped); `warn`
        gates log. A step that measured nothing passes every gate."""
        if "mismatch/k3" not in measured:
            return {}, None
        k3, abs_mean = measured["mismatch/k3"], measured["mismatch/abs_mean"]
        self.k3s.append(k3)
        k3_gate = self.gates.k3
        abs_mean_gate = self.gates.abs_mean
        growth = self.gates.growth
        tripped: list[tuple[str, str]] = []  # (action, line)
        if k3_gate.above is not None and k3 > k3_gate.above:
            tripped.append((k3_gate.action, _past("k3", k3, k3_gate.above, version)))
        if abs_mean_gate.above is not None and abs_mean > abs_mean_gate.above:
            tripped.append((abs_mean_gate.action, _past("abs_mean", abs_mean, abs_mean_gate.above, version)))
        if growth.above is not None and len(self.k3s) >= 2:
            first = min(growth.window, len(self.k3s) - 1)
            baseline = sum(self.k3s[:first]) / first
            latest = self.k3s[max(first, len(self.k3s) - growth.window):]
            mean = sum(latest) / len(latest)
            ratio = mean / max(baseline, growth.floor)
            if mean > growth.floor and ratio > growth.above:
                tripped.append((growth.action, f"mismatch k3 grew {ratio:.3g}x at step {version} (mean {mean:.3g} "
                                               f"over the latest {len(latest)} measured steps, {baseline:.3g} over "
                                               f"the first {first}), above precision.mismatch.gate.growth.above = "
                                               f"{growth.above:g}"))
        warnings = [line for action, line in tripped if action == "warn"]
        for line in warnings:
            log.warning("precision mismatch gate: %s", line)
        failures = [line for action, line in tripped if action == "fail"]
        return ({"mismatch_gate_warnings": float(len(warnings))} if warnings else {}), next(iter(failures), None)


def _past(name: str, value: float, above: float, version: int) -> str:
    return f"mismatch {name} {value:.3g} at step {version} is above precision.mismatch.gate.{name}.above = {above:g}"
