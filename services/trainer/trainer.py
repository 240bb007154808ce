"""The trainer: complete groups in, one optimizer step and one published weight version out, per step."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from jetroll.services.trainer.passes import PolicyPass, gradient_rows, policy_pass, reference_logp
from jetroll.shared.config.base import JobFailedError
from jetroll.shared.config.job import JobConfig
from jetroll.shared.model.checkpoint import load_pretrained, load_state, save_pretrained, torch_device
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.precision import published_dtype
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import MetricsEvent, ScoredEvent, WeightsPublishedEvent
from jetroll.shared.protocol.in_flight import InFlightIndex
from jetroll.shared.protocol.ledger import Ledger, Outcome
from jetroll.shared.protocol.topology import METRICS, TRAJ_SCORED, WEIGHTS
from jetroll.shared.protocol.validate import EventLimits, check_scored, expecting
from jetroll.shared.rl.admission import task_quotas
from jetroll.shared.rl.batch import GroupBuffer, PendingGroup, TokenBatch, collate
from jetroll.shared.rl.loss import group_advantages, loss_denominator, ppo_loss
from jetroll.shared.rl.mismatch import mismatch_stats, one_version_tokens
from jetroll.shared.rl.schedule import cosine_lr
from jetroll.shared.rl.staleness import fresh_tokens, staleness_stats
from jetroll.shared.store.base import Manifest, StepRecord, WeightStore
from jetroll.shared.tasks.registry import get_task

log = logging.getLogger("jetroll.trainer")

STREAM, GROUP = TRAJ_SCORED.name, TRAJ_SCORED.group
STATE_FILE = "trainer_state.json"
WEIGHTS_KEPT = 256  # weights announcements kept: readers need the newest; a controller this far behind skips evals


class TrainerState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The step a checkpoint's state came out of: what a restarted trainer re-records and acks."""

    version: int
    groups: dict[str, int]  # group id -> samples trained
    entry_ids: list[str]  # their scored entries


class Trainer:
    def __init__(self, config: JobConfig, bus: RedisBus, store: WeightStore, consumer: str) -> None:
        self.config = config
        self.bus = bus
        self.store = store
        self.consumer = consumer
        self.ledger = Ledger(bus)
        self.in_flight = InFlightIndex(bus)
        self.buffer = GroupBuffer()
        self.task_names = [task.name for task in config.tasks]
        self.quotas = task_quotas(config) if config.trainer.task_quotas else None
        self.version = 0
        self.stale_wait_s = 0.0  # waiting on an in-flight group that must join the step, with B groups at hand
        # the groups of the step in progress and of the commit in the background, acked once recorded
        self.training: dict[str, PendingGroup] = {}
        self.commit_task: asyncio.Task[None] | None = None
        self.claims_kept_at = 0.0
        self.publish_s = 0.0
        self.ingested = asyncio.Event()  # set after each read of the scored stream
        self.ingest_task: asyncio.Task[None] | None = None
        self.is_training = False
        self.has_taken_over = False
        self.redis_run_id = ""  # the Redis server's run id when the ledger was last known whole
        assert config.model.path, "the launcher resolves model.path before services start"
        self.device = torch_device(config.trainer.device, "trainer.device")
        self.model, self.tokenizer = load_pretrained(config.model.path, config.precision.numerics().trainer_side(),
                                                     self.device)
        self.model.train()
        limits = EventLimits.of(config, self.model.args.vocab_size)
        self.invalid: dict[str, str] = {}  # traj_id -> group_id of scored events dead-lettered since the last read

        def check(event: ScoredEvent) -> str | None:
            # tokens come only from published versions: none newer than the trainer's own
            reason = check_scored(event, limits, self.version)
            if reason is not None:
                self.invalid[event.trajectory.traj_id] = event.trajectory.group_id
            return reason

        self.is_scored = expecting(ScoredEvent, check)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.trainer.lr,
                                           weight_decay=config.trainer.weight_decay)
        self.reference: CausalLM | None = None
        if config.trainer.kl_coef > 0:
            self.reference, _ = load_pretrained(config.model.path, config.precision.numerics().trainer_side(),
                                                self.device)
            self.reference.requires_grad_(False)
            self.reference.share_inference_masters()

    async def run(self) -> None:
        torch.manual_seed(self.config.seed)
        await self.bus.ensure_group(STREAM, GROUP)
        await self._resume_or_publish_base()
        # scored trajectories are buffered all along, steps included: the next step's groups are at hand when it starts
        self.is_training = True
        self.ingest_task = asyncio.create_task(self._ingest_while_training())
        try:
            await self._train()
        finally:
            # the reader ends after its current read; a cancel could be lost inside redis-py on Python 3.11
            self.is_training = False
            await asyncio.wait({self.ingest_task})
        log.info("trainer done at version %d", self.version)

    async def _train(self) -> None:
        """Step, then commit the step in the background while the next one computes (the commit is mostly I/O);
        commits run one at a time, in version order."""
        cycle_started = time.perf_counter()
        while self.version < self.config.trainer.max_steps:
            if await self.bus.server_run_id() != self.redis_run_id:  # Redis restarted under a live trainer
                await self._last_commit()
                await self._rerecord_lost_steps(below=self.version + 1)
            waited = time.perf_counter()
            self.stale_wait_s = 0.0
            groups = await self._next_groups()
            started = time.perf_counter()
            self.training |= {g.group_id: g for g in groups}
            stats = await asyncio.to_thread(self._step, groups)
            self.version += 1
            stepped = time.perf_counter()
            trained, entry_ids = {g.group_id: len(g.samples) for g in groups}, [i for g in groups for i in g.entry_ids]
            staged = await asyncio.to_thread(self._stage, trained, entry_ids)
            staged_at = time.perf_counter()
            await self._last_commit()
            now = time.perf_counter()
            self.publish_s = now - stepped
            # a cycle runs from one step's start to the next: waiting for groups, the step, staging its commit
            stats |= {"step_time_s": stepped - started, "stage_s": staged_at - stepped,
                      "commit_wait_s": now - staged_at, "trainer_wait_s": started - waited,
                      "trainer_idle_frac": (started - waited) / (now - cycle_started),
                      "stale_wait_s": self.stale_wait_s}
            cycle_started = now
            self.commit_task = asyncio.create_task(self._commit(self.version, staged, trained, entry_ids, stats))
        await self._last_commit()

    async def _last_commit(self) -> None:
        if self.commit_task is not None:
            await self.commit_task
            self.commit_task = None

    async def _commit(self, version: int, staged: Path, trained: dict[str, int], entry_ids: list[str],
                      stats: dict[str, float]) -> None:
        """Make the step that made `version` survive, in the order a crash anywhere can be finished from: the trainer
        state first (the commit point), then the step's record, the ledger and the acks (a restarted trainer redoes
        these from the state: each is idempotent), then its metrics and weights."""
        try:
            await self.store.save_checkpoint(version, staged / "state")
            await self._record_step(version, trained, entry_ids)
            for group_id in trained:
                del self.training[group_id]
            await self.store.retain_checkpoints(self.config.store.keep_checkpoints,
                                                self.config.trainer.checkpoint_every)
            # metrics before the weights event: the controller stops at the last version, its row already read
            await self._emit(version, stats)
            await self._publish(version, staged / "weights")
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # restarting would only fill the disk again: fail the job, resumable once there is room
            raise JobFailedError(
                f"the weight store ran out of space committing step {version} ({exc}); LATEST stays at the last "
                f"version written whole. Free space and run the job again with job_id {self.config.job_id} and the "
                "same run dir: it resumes from the last committed step") from exc
        finally:
            await asyncio.to_thread(shutil.rmtree, staged, True)

    async def _record_step(self, version: int, groups: dict[str, int], entry_ids: list[str]) -> None:
        await self.store.record_step(StepRecord(version=version, groups=groups, created_at=time.time()))
        await self.ledger.record({g: Outcome(version, "trained", n) for g, n in groups.items()},
                                 keep_groups=self.config.redis.ledger_keep_groups)
        await self.bus.ack(STREAM, GROUP, *entry_ids)

    async def _next_groups(self) -> list[PendingGroup]:
        """B complete groups, oldest v_adm first; waits while an in-flight group that must join this step is not
        complete, even with B other groups at hand."""
        needed = self.config.trainer.groups_per_step
        while (groups := self.buffer.take_oldest(needed, await self._required_groups(), self.quotas)) is None:
            waited = time.perf_counter()
            is_stale_wait = self.buffer.num_complete >= needed
            await self._next_ingest()
            if is_stale_wait:
                self.stale_wait_s += time.perf_counter() - waited
        return groups

    async def _next_ingest(self) -> None:
        """Wait for the next read of the scored stream; a failure of the reader or of the commit in the background
        surfaces here."""
        assert self.ingest_task is not None
        self.ingested.clear()
        waiter = asyncio.ensure_future(self.ingested.wait())
        watched = {waiter, self.ingest_task, *([self.commit_task] if self.commit_task else [])}
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self.ingest_task.done():
            self.ingest_task.result()
        if self.commit_task is not None and self.commit_task.done():
            await self._last_commit()

    async def _ingest_while_training(self) -> None:
        while self.is_training:
            await self._ingest()
            self.ingested.set()

    async def _ingest(self) -> None:
        """One read of the scored stream into the buffer; a copy of a traj_id already held or recorded is acked."""
        if time.monotonic() - self.claims_kept_at > self.config.redis.claim_idle_ms / 3000:
            held = [*self.buffer.groups.values(), *self.training.values()]
            await self.bus.keep_claimed(STREAM, GROUP, self.consumer, [i for g in held for i in g.entry_ids])
            self.claims_kept_at = time.monotonic()
        if self.has_taken_over:
            deliveries = await self.bus.consume(STREAM, GROUP, self.consumer, count=256, block_ms=500,
                                                check=self.is_scored)
        else:  # the trainer is the group's only consumer: what is pending is an earlier life's, so ours now
            deliveries = await self.bus.take_over(STREAM, GROUP, self.consumer, check=self.is_scored)
            self.has_taken_over = True
        if not deliveries:
            return
        done = await self.ledger.recorded({d.event.trajectory.group_id for d in deliveries}) | set(self.training)
        for delivery in deliveries:
            event = delivery.event
            assert isinstance(event, ScoredEvent)  # `is_scored` dead-lettered anything else
            if self._held_entry(event) == delivery.entry_id:
                continue  # our own held entry handed back by XAUTOCLAIM: it stays pending until trained
            if event.trajectory.group_id in done or not self.buffer.add(delivery.entry_id, event):
                await self.bus.ack(STREAM, GROUP, delivery.entry_id)  # a reclaimed copy: keep the first
        await self._drop_failed()
        if self.invalid:
            await self._drop_invalid()

    async def _drop_invalid(self) -> None:
        """Drop each in-flight group whose missing sample came only as a dead-lettered event: it could never
        complete, and the eta_hard wait would wait on it for good. An invalid copy of a sample already held is
        only dead-lettered."""
        invalid, self.invalid = self.invalid, {}
        live, done = await self.in_flight.members(), await self.ledger.recorded(set(invalid.values()))
        dropped: dict[str, PendingGroup | None] = {}
        for traj_id, group_id in invalid.items():
            held = self.buffer.groups.get(group_id)
            if group_id in live and group_id not in done and group_id not in self.training and \
                    not (held and traj_id in held.samples):
                dropped[group_id] = self.buffer.groups.pop(group_id, None)
        if not dropped:
            return
        log.warning("dropping %d groups with an invalid sample (see the dlq): %s", len(dropped), sorted(dropped))
        await self.ledger.record({g: Outcome(self.version, "dropped:invalid", len(p.samples) if p else 0)
                                  for g, p in dropped.items()}, keep_groups=self.config.redis.ledger_keep_groups)
        await self.bus.ack(STREAM, GROUP, *(i for p in dropped.values() if p for i in p.entry_ids))

    async def _required_groups(self) -> frozenset[str]:
        """In-flight groups this step must include: trained any later, their oldest tokens would lag more than
        eta_hard. At most B, the oldest; the rest cannot fit this step, and their late tokens get masked."""
        newest = self.version - self.config.staleness.eta_hard
        if newest < 0:
            return frozenset()
        return await self.in_flight.oldest_at_or_below(newest, self.config.trainer.groups_per_step)

    def _held_entry(self, event: ScoredEvent) -> str | None:
        group = self.buffer.groups.get(event.trajectory.group_id) or self.training.get(event.trajectory.group_id)
        held = group.samples.get(event.trajectory.traj_id) if group else None
        return held[0] if held else None

    async def _drop_failed(self) -> None:
        failed = self.buffer.take_failed()
        if not failed:
            return
        await self.ledger.record({g.group_id: Outcome(self.version, f"dropped:{g.failed_status}", len(g.samples))
                                  for g in failed}, keep_groups=self.config.redis.ledger_keep_groups)
        await self.bus.ack(STREAM, GROUP, *(i for g in failed for i in g.entry_ids))

    def _step(self, groups: list[PendingGroup]) -> dict[str, float]:
        """One optimizer step (or, with trainer.engine timing, a sleep standing in for it) and its staleness stats."""
        if self.config.trainer.engine == "timing":
            # the modelled time covers the step and its weight publication, which stays real
            time.sleep(max(0.0, self.config.trainer.timing_step_s - self.publish_s))
            stats = {}
        else:
            stats = self._train_step(groups)
        trajectories = [e.trajectory for g in groups for e in g.events]
        per_task = {f"groups/{task}": float(sum(g.task == task for g in groups)) for task in self.task_names}
        return stats | per_task | staleness_stats(trajectories, self.version, self.config.staleness.eta_hard)

    def _train_step(self, groups: list[PendingGroup]) -> dict[str, float]:
        """batch -> pi_prox -> advantages -> the corrected PPO loss -> one optimizer step (the caller publishes)."""
        cfg = self.config.trainer
        batch = collate(groups, self.tokenizer.pad_id, self.device)
        # a group whose rewards are all equal has zero advantage, so its tokens add nothing to the PPO gradient: they
        # get only the no-grad pi_prox pass (cheaper than forward + backward), unless a KL term gives them a gradient
        with_grad = gradient_rows(batch.rewards, has_kl=self.reference is not None)
        self.optimizer.zero_grad(set_to_none=True)
        policy = policy_pass(self.model, batch, with_grad, self.tokenizer.pad_id, entropy_grad=cfg.entropy_coef > 0)
        advantages = group_advantages(batch.rewards, cfg.advantage).flatten()
        loss_mask = fresh_tokens(batch.loss_mask, batch.v_tok, self.version, self.config.staleness.eta_hard)
        stats: dict[str, float] = {"grad_rows_frac": float(with_grad.float().mean()), "lr": self._lr()}
        if policy.logp is not None:  # with no signal at all there is nothing to step on (not even Adam's momentum)
            rows, width = policy.rows, policy.width
            loss, loss_stats = ppo_loss(
                policy.logp, policy.prox_logp[rows, :width], batch.behavior_logp[rows, :width], advantages[rows],
                loss_mask[rows, :width], cfg, denominator=self._loss_denominator(batch, loss_mask),
                ref_logp=self._reference_logp(batch, rows, width), correction=self.config.precision,
                entropy=policy.row_entropy)
            stats |= loss_stats | self._optimizer_step(loss, stats["lr"])
        return stats | self._batch_stats(batch, policy)

    def _loss_denominator(self, batch: TokenBatch, loss_mask: torch.Tensor) -> float:
        budgets = [self.config.rollout.sample_budget(get_task(task).max_new_tokens) for task in batch.tasks]
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
        mask = batch.loss_mask > 0
        # of pi_prox, the policy at the start of the step, over every policy token (zero-advantage groups included)
        entropy = float(policy.entropy[mask].mean()) if mask.any() else float("nan")
        return {"entropy": entropy} | self._mismatch_stats(batch, policy.prox_logp) | self._task_stats(batch)

    def _lr(self) -> float:
        """This step's learning rate: a pure function of the version, so a resumed run picks the schedule up."""
        cfg = self.config.trainer
        decay_start = cfg.max_steps if cfg.lr_schedule == "constant" else round(cfg.max_steps * (1 - cfg.lr_decay_frac))
        return cosine_lr(self.version, cfg.max_steps, cfg.lr, warmup_steps=cfg.warmup_steps,
                         final_ratio=cfg.lr_final_ratio, hold_steps=max(0, decay_start - cfg.warmup_steps))

    def _mismatch_stats(self, batch: TokenBatch, prox_logp: torch.Tensor) -> dict[str, float]:
        mask = batch.loss_mask > 0
        same_version = one_version_tokens(mask, batch.v_tok, self.version,
                                          kept_kv=not self.config.rollout.recompute_kv_on_swap)
        abs_delta = (prox_logp - batch.behavior_logp).abs()
        delta = abs_delta[same_version]
        per_pool = {}  # pools may run different engines: each has its own gap to the trainer
        for pool in sorted(set(batch.pools)):
            rows = torch.tensor([p == pool for p in batch.pools], device=mask.device)
            pool_delta = abs_delta[same_version & rows[:, None]]
            per_pool[f"mismatch/pool/{pool}"] = float(pool_delta.mean()) if pool_delta.numel() else float("nan")
        stats = mismatch_stats(prox_logp, batch.behavior_logp, same_version, self.config.precision.correction_cap)
        return stats | per_pool | {
            "mismatch_abs_sum": float(delta.sum()),
            "mismatch_abs_max": float(delta.max()) if delta.numel() else 0.0,
            "mismatch_tokens": float(same_version.sum()),
            "num_policy_tokens": float(mask.sum()),
            "precision_mismatch": float(delta.mean()) if delta.numel() else float("nan"),
            "mismatch_coverage": float(same_version.sum() / mask.sum().clamp(min=1)),
        }

    def _task_stats(self, batch: TokenBatch) -> dict[str, float]:
        rewards = batch.rewards.flatten().tolist()
        stats: dict[str, float] = {"reward_mean": sum(rewards) / len(rewards)}
        for task in sorted(set(batch.tasks)):
            rows = [i for i, t in enumerate(batch.tasks) if t == task]
            stats[f"reward/{task}"] = sum(rewards[i] for i in rows) / len(rows)
            stats[f"accuracy/{task}"] = sum(batch.is_correct[i] for i in rows) / len(rows)
        return stats

    def _stage(self, groups: dict[str, int], entry_ids: list[str]) -> Path:
        """Write the commit of `self.version` to a local staging dir (the CPU part, before the weights change again):
        `state/`, the trainer state with the step's groups, and `weights/`, the version as rollout computes with it."""
        staged = Path(tempfile.mkdtemp(prefix="jetroll-commit-"))
        state_dir = staged / "state"
        save_pretrained(self.model, self.tokenizer, state_dir)
        tensors = {}
        for name, param in self.model.named_parameters():
            state = self.optimizer.state.get(param, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    tensors[f"{name}::{key}"] = state[key].detach().reshape(-1)  # a view: the step waits for this
        tensors["rng::torch"] = torch.get_rng_state()
        save_file(tensors, str(state_dir / "optimizer.safetensors"))
        trainer_state = TrainerState(version=self.version, groups=groups, entry_ids=entry_ids)
        (state_dir / STATE_FILE).write_bytes(msgspec.json.encode(trainer_state))
        # the linears as rollout computes with them (FP8 + scales, or bf16): the trainer's forward uses the same
        save_pretrained(self.model, self.tokenizer, staged / "weights", publish=self.config.precision.numerics())
        return staged

    @contextlib.asynccontextmanager
    async def _staged(self, groups: dict[str, int], entry_ids: list[str]) -> AsyncIterator[Path]:
        """`_stage` for a commit written in line (start-up and resume), removed afterwards."""
        staged = await asyncio.to_thread(self._stage, groups, entry_ids)
        try:
            yield staged
        finally:
            await asyncio.to_thread(shutil.rmtree, staged, True)

    async def _publish(self, version: int, weights_dir: Path) -> None:
        """Shards, manifest, LATEST (inside the store), then the weights event."""
        manifest = await self.store.publish(
            version, version, weights_dir, precision_id=self.config.precision.precision_id,
            dtype=published_dtype(self.config.precision.numerics()), parent=version - 1 if version else None,
            is_checkpoint=version % self.config.trainer.checkpoint_every == 0)
        await self._announce(manifest)
        await self.store.retain(self.config.store.keep_last)

    async def _announce(self, manifest: Manifest) -> None:
        await self.bus.publish(WEIGHTS, WeightsPublishedEvent(
            job_id=self.config.job_id, version=manifest.version, step=manifest.step,
            manifest_uri=self.store.uri(manifest.version), shard_sha256={s.key: s.sha256 for s in manifest.shards},
            size_bytes=sum(s.size_bytes for s in manifest.shards), precision_id=manifest.precision_id),
            maxlen=WEIGHTS_KEPT)

    async def _resume_or_publish_base(self) -> None:
        """Fresh: save the state of v0 and publish it. Resumed: load the newest trainer state that verifies, finish
        its step's commit, and publish its version unless the store holds it; a trainer never resumes behind a
        version it published, so each version names one set of weights."""
        checkpoint = await self.store.latest_checkpoint()
        latest = await self.store.latest()
        if checkpoint is None:
            if latest is not None:
                raise RuntimeError(f"store holds version {latest} but no trainer state; use a fresh run dir")
            async with self._staged({}, []) as staged:
                await self.store.save_checkpoint(0, staged / "state")
                await self._publish(0, staged / "weights")
            return
        step, directory = checkpoint
        state = self._load_checkpoint(directory)
        if latest is not None and latest > step:
            raise RuntimeError(f"the store's LATEST is version {latest}, but its newest trainer state that verifies "
                               f"is step {step}: the state behind versions {step + 1}..{latest} is lost, so this "
                               "job cannot go on exactly once; start it again in a fresh run dir")
        self.version = step
        await self._rerecord_lost_steps(below=step)  # `step` itself is recorded, with its acks, next
        if step:
            await self._record_step(step, state.groups, state.entry_ids)
        log.info("resumed from checkpoint step %d at version %d", step, self.version)
        if latest == step:
            await self._announce(await self.store.manifest(latest))  # the last life may have died before this
            return
        async with self._staged(state.groups, state.entry_ids) as staged:
            await self._publish(step, staged / "weights")

    async def _rerecord_lost_steps(self, below: int) -> None:
        """A machine crash can lose the last second of Redis' writes (AOF everysec), and with them the ledger's
        records of steps the store holds; their entries, unacked, come back, and would train again. So re-record
        every stored step under `below` above the ledger's newest (re-recording a group is a no-op). A drop is
        recorded at the trainer's version, up to two versions before that version's commit lands: hence the margin."""
        self.redis_run_id = await self.bus.server_run_id()
        newest = (await self.ledger.totals()).max_step
        for record in await self.store.step_records(after=max(0, newest - 2)):
            if record.version < below:
                await self.ledger.record({g: Outcome(record.version, "trained", n) for g, n in record.groups.items()},
                                         keep_groups=self.config.redis.ledger_keep_groups)

    def _load_checkpoint(self, directory: Path) -> TrainerState:
        try:
            state = msgspec.json.decode((directory / STATE_FILE).read_bytes(), type=TrainerState)
        except (OSError, msgspec.DecodeError) as exc:  # unknown fields too: nothing loads half-understood
            raise RuntimeError(f"trainer state {directory / STATE_FILE}: {exc}") from None
        weights = load_file(str(directory / "model.safetensors"))
        load_state(self.model, weights)
        tensors = load_file(str(directory / "optimizer.safetensors"))  # fresh, writable tensors: no clone needed
        for name, param in self.model.named_parameters():
            if f"{name}::step" in tensors:
                self.optimizer.state[param] = {
                    "step": tensors[f"{name}::step"].reshape(()),  # AdamW keeps its step count on the host
                    "exp_avg": tensors[f"{name}::exp_avg"].view_as(param).to(param.device),
                    "exp_avg_sq": tensors[f"{name}::exp_avg_sq"].view_as(param).to(param.device),
                }
        torch.set_rng_state(tensors["rng::torch"])
        return state

    async def _emit(self, version: int, stats: dict[str, float]) -> None:
        events = [MetricsEvent(job_id=self.config.job_id, service="trainer", name=name, value=float(value),
                               step=version) for name, value in stats.items()]
        events.append(MetricsEvent(job_id=self.config.job_id, service="trainer", name="step_done", value=1.0,
                                   step=version))
        await self.bus.publish_many(METRICS, events)
