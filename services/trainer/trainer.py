"""The trainer: complete groups in, one optimizer step and one published weight version out, per step."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.trainer.batch import GroupBuffer, PendingGroup, TokenBatch, collate
from services.trainer.loss import group_advantages, ppo_loss, token_logprobs
from shared.bus import RedisBus
from shared.config import JobConfig
from shared.events import MetricsEvent, ScoredEvent, WeightsPublishedEvent
from shared.model import CausalLM, load_pretrained, load_state, save_pretrained
from shared.store import Manifest, WeightStore

log = logging.getLogger("jetroll.trainer")

STREAM, GROUP = "traj:scored", "trainer"


class Ledger:
    """Redis hash group_id -> outcome. A group is recorded once; entries are acked only after recording."""

    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus
        self.key = bus.key("ledger")

    async def has(self, group_id: str) -> bool:
        return bool(await self.bus.redis.hexists(self.key, group_id))

    async def record(self, outcomes: dict[str, dict]) -> None:
        async with self.bus.redis.pipeline(transaction=True) as pipe:
            for group_id, outcome in outcomes.items():
                pipe.hsetnx(self.key, group_id, json.dumps(outcome))
            await pipe.execute()

    async def dump(self) -> dict[str, dict]:
        raw = await self.bus.redis.hgetall(self.key)
        return {k.decode(): json.loads(v) for k, v in raw.items()}


class Trainer:
    def __init__(self, config: JobConfig, bus: RedisBus, store: WeightStore, consumer: str) -> None:
        self.config = config
        self.bus = bus
        self.store = store
        self.consumer = consumer
        self.ledger = Ledger(bus)
        self.buffer = GroupBuffer()
        self.version = 0
        assert config.model.path, "the launcher resolves model.path before services start"
        self.model, self.tokenizer = load_pretrained(config.model.path, config.precision)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.trainer.lr,
                                           weight_decay=config.trainer.weight_decay)
        self.reference: CausalLM | None = None
        if config.trainer.kl_coef > 0:
            self.reference, _ = load_pretrained(config.model.path, config.precision)
            self.reference.requires_grad_(False)

    async def run(self) -> None:
        torch.manual_seed(self.config.trainer.seed)
        await self.bus.ensure_group(STREAM, GROUP)
        await self._resume_or_publish_base()
        while self.version < self.config.trainer.max_steps:
            groups = await self._next_groups()
            started = time.perf_counter()
            stats = await asyncio.to_thread(self._train_step, groups)
            self.version += 1
            # ledger first: a group is trained exactly once even if we die before the publish below
            await self.ledger.record({g.group_id: {"step": self.version, "status": "trained",
                                                   "traj_ids": sorted(g.samples)} for g in groups})
            await self.bus.ack(STREAM, GROUP, *(i for g in groups for i in g.entry_ids))
            stats["step_time_s"] = time.perf_counter() - started
            # metrics before the weights event: the controller stops at the last version, its row already read
            await self._emit(stats)
            await self._publish()
            if self.version % self.config.trainer.checkpoint_every == 0:
                await self._checkpoint()
        log.info("trainer done at version %d", self.version)

    async def _next_groups(self) -> list[PendingGroup]:
        needed = self.config.trainer.groups_per_step
        while (groups := self.buffer.take_oldest(needed)) is None:
            await self.bus.keep_claimed(STREAM, GROUP, self.consumer,
                                        [i for g in self.buffer.groups.values() for i in g.entry_ids])
            for delivery in await self.bus.consume(STREAM, GROUP, self.consumer, count=256, block_ms=500):
                event = delivery.event
                assert isinstance(event, ScoredEvent)
                if self._held_entry(event) == delivery.entry_id:
                    continue  # our own buffered entry handed back by XAUTOCLAIM: it stays pending until trained
                is_done = await self.ledger.has(event.trajectory.group_id)
                if is_done or not self.buffer.add(delivery.entry_id, event):
                    await self.bus.ack(STREAM, GROUP, delivery.entry_id)  # a reclaimed copy: keep the first
            await self._drop_failed()
        return groups

    def _held_entry(self, event: ScoredEvent) -> str | None:
        group = self.buffer.groups.get(event.trajectory.group_id)
        held = group.samples.get(event.trajectory.traj_id) if group else None
        return held[0] if held else None

    async def _drop_failed(self) -> None:
        failed = self.buffer.take_failed()
        if not failed:
            return
        await self.ledger.record({g.group_id: {"step": self.version, "status": f"dropped:{g.failed_status}",
                                               "traj_ids": sorted(g.samples)} for g in failed})
        await self.bus.ack(STREAM, GROUP, *(i for g in failed for i in g.entry_ids))
        for group in failed:
            await self._metric(f"dropped/{group.failed_status}", 1.0)

    def _train_step(self, groups: list[PendingGroup]) -> dict[str, float]:
        cfg = self.config.trainer
        batch = collate(groups, self.tokenizer.pad_id)
        advantages = group_advantages(batch.rewards, cfg.advantage).flatten()
        eta_hard = 2 * self.config.staleness.eta
        lag = (self.version - batch.v_tok) * batch.loss_mask.long()
        is_too_stale = (lag > eta_hard) & (batch.loss_mask > 0)
        loss_mask = batch.loss_mask * (~is_too_stale)

        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(batch.input_ids)
        logp = token_logprobs(logits, batch.targets, batch.temperature)
        # one update per version, so pi_prox (the weights at the start of the step) is this forward, detached
        prox_logp = logp.detach()
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(self.reference(batch.input_ids), batch.targets, batch.temperature)
        denominator = None
        if cfg.advantage == "dr_grpo":
            denominator = float(len(advantages) * batch.loss_mask.shape[1])
        loss, stats = ppo_loss(logp, prox_logp, batch.behavior_logp, advantages, loss_mask, cfg,
                               dr_grpo_denominator=denominator, ref_logp=ref_logp)
        loss.backward()
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        self.optimizer.step()
        stats.update(self._staleness_stats(batch, prox_logp, lag, is_too_stale))
        stats.update(self._task_stats(batch))
        return stats

    def _staleness_stats(self, batch: TokenBatch, prox_logp: torch.Tensor, lag: torch.Tensor,
                         is_too_stale: torch.Tensor) -> dict[str, float]:
        mask = batch.loss_mask > 0
        same_version = mask & (batch.v_tok == self.version)
        delta = (prox_logp - batch.behavior_logp).abs()[same_version]
        seq_lag = lag.max(dim=1).values.float()
        versions_per_seq = [len(set(batch.v_tok[i][mask[i]].tolist())) for i in range(len(mask))]
        return {
            "mismatch_abs_sum": float(delta.sum()),
            "mismatch_abs_max": float(delta.max()) if delta.numel() else 0.0,
            "mismatch_tokens": float(same_version.sum()),
            "num_policy_tokens": float(mask.sum()),
            "precision_mismatch": float(delta.mean()) if delta.numel() else float("nan"),
            "mismatch_coverage": float(same_version.sum() / mask.sum().clamp(min=1)),
            "lag_mean": float(seq_lag.mean()),
            "lag_p50": float(seq_lag.median()),
            "lag_max": float(seq_lag.max()),
            "mixed_version_frac": sum(n > 1 for n in versions_per_seq) / len(versions_per_seq),
            "stale_masked_tokens": float(is_too_stale.sum()),
        }

    def _task_stats(self, batch: TokenBatch) -> dict[str, float]:
        rewards = batch.rewards.flatten().tolist()
        stats: dict[str, float] = {"reward_mean": sum(rewards) / len(rewards)}
        for task in sorted(set(batch.tasks)):
            rows = [i for i, t in enumerate(batch.tasks) if t == task]
            stats[f"reward/{task}"] = sum(rewards[i] for i in rows) / len(rows)
            stats[f"accuracy/{task}"] = sum(batch.is_correct[i] for i in rows) / len(rows)
        return stats

    async def _publish(self) -> None:
        """Shards, manifest, LATEST (inside the store), then the weights event."""
        with tempfile.TemporaryDirectory(prefix="jetroll-publish-") as staging:
            save_pretrained(self.model, self.tokenizer, staging)
            is_ckpt = self.version % self.config.trainer.checkpoint_every == 0
            manifest = await self.store.publish(
                self.version, self.version, Path(staging), precision_id=self.config.precision.precision_id,
                dtype="float32", parent=self.version - 1 if self.version else None, is_checkpoint=is_ckpt)
        await self._announce(manifest)
        await self.store.retain(self.config.store.keep_last)

    async def _announce(self, manifest: Manifest) -> None:
        await self.bus.publish("weights", WeightsPublishedEvent(
            job_id=self.config.job_id, version=manifest.version, step=manifest.step,
            manifest_uri=self.store.uri(manifest.version), shard_sha256={s.key: s.sha256 for s in manifest.shards},
            size_bytes=sum(s.size_bytes for s in manifest.shards), precision_id=manifest.precision_id))

    async def _resume_or_publish_base(self) -> None:
        """Fresh: publish v0 and checkpoint it. Resumed: restore the last checkpoint and move on from the
        newest version any earlier life reached (store or ledger), so versions never go back."""
        checkpoint = await self.store.latest_checkpoint()
        latest = await self.store.latest()
        if checkpoint is None:
            if latest is not None:
                raise RuntimeError(f"store holds version {latest} but no checkpoint; use a fresh run dir")
            await self._publish()
            await self._checkpoint()
            return
        step, directory = checkpoint
        self._load_checkpoint(directory)
        ledger_step = max((o["step"] for o in (await self.ledger.dump()).values()), default=0)
        self.version = max(step, latest or 0, ledger_step)
        log.info("resumed from checkpoint step %d at version %d", step, self.version)
        if latest is not None and latest >= self.version:
            await self._announce(await self.store.manifest(latest))  # the last life may have died before this
        else:
            await self._publish()

    async def _checkpoint(self) -> None:
        with tempfile.TemporaryDirectory(prefix="jetroll-ckpt-") as staging:
            save_pretrained(self.model, self.tokenizer, staging)
            tensors = {}
            for name, param in self.model.named_parameters():
                state = self.optimizer.state.get(param, {})
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    if key in state:
                        tensors[f"{name}::{key}"] = state[key].detach().reshape(-1).clone()
            tensors["rng::torch"] = torch.get_rng_state()
            save_file(tensors, str(Path(staging) / "optimizer.safetensors"))
            ledger = await self.ledger.dump()
            meta = {"step": self.version, "version": self.version, "ledger": ledger}
            (Path(staging) / "trainer_state.json").write_text(json.dumps(meta))
            await self.store.save_checkpoint(self.version, Path(staging))

    def _load_checkpoint(self, directory: Path) -> None:
        weights = load_file(str(directory / "model.safetensors"))
        load_state(self.model, weights)
        tensors = load_file(str(directory / "optimizer.safetensors"))
        for name, param in self.model.named_parameters():
            if f"{name}::step" in tensors:
                self.optimizer.state[param] = {
                    "step": tensors[f"{name}::step"].reshape(()),
                    "exp_avg": tensors[f"{name}::exp_avg"].view_as(param).clone(),
                    "exp_avg_sq": tensors[f"{name}::exp_avg_sq"].view_as(param).clone(),
                }
        torch.set_rng_state(tensors["rng::torch"])

    async def _emit(self, stats: dict[str, float]) -> None:
        events = [MetricsEvent(job_id=self.config.job_id, service="trainer", name=name, value=float(value),
                               step=self.version) for name, value in stats.items()]
        events.append(MetricsEvent(job_id=self.config.job_id, service="trainer", name="step_done", value=1.0,
                                   step=self.version))
        await self.bus.publish_many("metrics", events)

    async def _metric(self, name: str, value: float) -> None:
        await self.bus.publish("metrics", MetricsEvent(job_id=self.config.job_id, service="trainer", name=name,
                                                       value=value, step=self.version))

