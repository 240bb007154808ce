"""The commit of a step: its checkpoint staged, saved, recorded (store, ledger, acks), its metrics emitted and its
weights published; and a restarted trainer's resume from the newest checkpoint that verifies."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import load_file

from jetroll.services.trainer.actor import Actor
from jetroll.services.trainer.mismatch import MismatchGateKeeper
from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.errors import JobFailedError
from jetroll.shared.model.checkpoint import (
    load_state,
    pretrained_tensors,
    quantization_plan,
    save_tensors,
    write_pretrained,
)
from jetroll.shared.model.precision import published_dtype
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import MetricsEvent, WeightsPublishedEvent
from jetroll.shared.protocol.ledger import Ledger, Outcome
from jetroll.shared.protocol.topology import METRICS, TRAJ_SCORED, WEIGHTS
from jetroll.shared.store.base import Manifest, StepRecord, WeightStore

log = logging.getLogger("jetroll.trainer")

STATE_FILE = "trainer_state.json"
WEIGHTS_KEPT = 256  # weights announcements kept: readers need the newest; a controller this far behind skips evals


class TrainerState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The step a checkpoint's state came out of: what a restarted trainer re-records and acks."""

    version: int
    groups: dict[str, int]  # group id -> samples trained
    entry_ids: list[str]  # their scored entries


@dataclass(frozen=True, slots=True)
class StagedStep:
    """A step's commit in memory: copies of what its files hold, `state/` (the trainer state) and `weights/` (the
    published version)."""

    masters: dict[str, torch.Tensor]
    model_config: dict[str, Any]
    optimizer: dict[str, torch.Tensor]
    state: TrainerState
    weights: dict[str, torch.Tensor]
    weights_config: dict[str, Any]

    def write(self, directory: Path, tokenizer: Tokenizer) -> None:
        """Each distinct file once: the version's files that equal the checkpoint's (the tokenizer's always, the
        model's too when the masters are what rollout computes with) are links to them."""
        state, weights = directory / "state", directory / "weights"
        write_pretrained(state, self.masters, self.model_config, tokenizer)
        pretrained = [path.name for path in state.iterdir()]
        save_tensors(state / "optimizer.safetensors", self.optimizer)
        (state / STATE_FILE).write_bytes(msgspec.json.encode(self.state))
        shared = self.weights.keys() == self.masters.keys() and self.weights_config == self.model_config and all(
            tensor is self.masters[name] for name, tensor in self.weights.items())
        if not shared:
            write_pretrained(weights, self.weights, self.weights_config, None)
        weights.mkdir(exist_ok=True)
        for name in pretrained:
            if not (weights / name).exists():
                os.link(state / name, weights / name)


def _identity(tensor: torch.Tensor) -> tuple[int, torch.Size, torch.dtype]:
    """Two views with this in common hold the same values."""
    return tensor.data_ptr(), tensor.shape, tensor.dtype


class Committer:
    def __init__(self, config: TrainerSections, bus: RedisBus, store: WeightStore, ledger: Ledger, actor: Actor,
                 release: Callable[[Iterable[str]], None]) -> None:
        self.config = config
        self.bus = bus
        self.store = store
        self.ledger = ledger
        self.actor = actor
        self.release = release  # the intake's: a step's groups leave it once the step is recorded
        self.redis_run_id = ""  # the Redis server's run id when the ledger was last known whole
        self.gates = MismatchGateKeeper(config.precision.mismatch.gate)
        self.plan = quantization_plan(actor.model.args, config.precision.numerics())
        self.precision_id = config.precision.precision_id(self.plan.digest)

    def stage(self, version: int, groups: dict[str, int], entry_ids: list[str]) -> StagedStep:
        """Copy the commit of `version` in memory (all the next step must wait for, before the weights change
        again): the trainer state (fp32 masters, AdamW moments, RNG, the step's groups) and the version as rollout
        computes with it. The commit writes the files in the background."""
        model = self.actor.model
        masters, model_config = pretrained_tensors(model)
        tensors = {}
        for name, param in model.named_parameters():
            state = self.actor.optimizer.state.get(param, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    tensors[f"{name}::{key}"] = state[key].detach().reshape(-1).clone()
        tensors["rng::torch"] = torch.get_rng_state()
        # the linears as rollout computes with them (FP8 + scales, or bf16): the trainer's forward uses the same
        weights, weights_config = pretrained_tensors(model, publish=self.config.precision.numerics(),
                                                     is_refit=version > 0)
        if (problem := self.plan.check_tensors(weights)) is not None:  # both sides check: the publisher first
            raise RuntimeError(f"version {version} does not follow the trainer's quantization plan: {problem}")
        copies = {_identity(v): v.clone() for v in masters.values()}
        # an fp32 linear publishes its master itself: one copy serves both files
        copies |= {_identity(v): v.clone() for v in weights.values() if _identity(v) not in copies}
        return StagedStep(
            masters={k: copies[_identity(v)] for k, v in masters.items()}, model_config=model_config,
            optimizer=tensors, state=TrainerState(version=version, groups=groups, entry_ids=entry_ids),
            weights={k: copies[_identity(v)] for k, v in weights.items()}, weights_config=weights_config)

    async def commit(self, version: int, staged: StagedStep, trained: dict[str, int], entry_ids: list[str],
                     stats: dict[str, float], measuring: asyncio.Task[dict[str, float]]) -> None:
        """Make the step that made `version` survive, in the order a crash anywhere can be finished from: the trainer
        state first (the commit point), then the step's record, the ledger and the acks (a restarted trainer redoes
        these from the state: each is idempotent), then its metrics and weights. `measuring` scores the step's
        mismatch meanwhile; its figures join the step's metrics."""
        try:
            async with self.store.staging() as directory:
                await asyncio.to_thread(staged.write, directory, self.actor.tokenizer)
                await self.store.save_checkpoint(version, directory / "state")
                await self.record_step(version, trained, entry_ids)
                self.release(trained)
                await self.store.retain_checkpoints(self.config.store.keep_checkpoints,
                                                    self.config.trainer.checkpoint_every)
                # metrics before the weights event: the controller stops at the last version, its row already read
                measured = await measuring
                gate_stats, failed_gate = self.gates.check(version, measured)
                await self._emit(version, stats | measured | gate_stats)
                if failed_gate is not None:  # the step's row is out; its weights never serve
                    raise JobFailedError(f"precision mismatch gate: {failed_gate}")
                await self._publish(version, directory / "weights")
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # restarting would only fill the disk again: fail the job, resumable once there is room
            raise JobFailedError(
                f"the weight store ran out of space committing step {version} ({exc}); LATEST stays at the last "
                f"version written whole. Free space and run the job again with job_id {self.config.job_id} and the "
                "same run dir: it resumes from the last committed step") from exc
        finally:
            await asyncio.wait({measuring})  # a failed commit leaves no measurement running behind it

    async def record_step(self, version: int, groups: dict[str, int], entry_ids: list[str]) -> None:
        await self.store.record_step(StepRecord(version=version, groups=groups, created_at=time.time()))
        await self.ledger.record({g: Outcome(version, "trained", n) for g, n in groups.items()},
                                 keep_groups=self.config.redis.ledger_keep_groups)
        await self.bus.ack(TRAJ_SCORED.name, TRAJ_SCORED.group, *entry_ids)

    async def resume_or_publish_base(self) -> int:
        """Fresh: save the state of v0 and publish it. Resumed: load the newest trainer state that verifies, finish
        its step's commit, and publish its version unless the store holds it; a trainer never resumes behind a
        version it published, so each version names one set of weights. Returns the version to go on from."""
        checkpoint = await self.store.latest_checkpoint()
        latest = await self.store.latest()
        if checkpoint is None:
            if latest is not None:
                raise RuntimeError(f"store holds version {latest} but no trainer state; use a fresh run dir")
            async with self._staged(0, {}, []) as staged:
                await self.store.save_checkpoint(0, staged / "state")
                await self._publish(0, staged / "weights")
            return 0
        step, directory = checkpoint
        state = self._load_checkpoint(directory)
        if latest is not None and latest > step:
            raise RuntimeError(f"the store's LATEST is version {latest}, but its newest trainer state that verifies "
                               f"is step {step}: the state behind versions {step + 1}..{latest} is lost, so this "
                               "job cannot go on exactly once; start it again in a fresh run dir")
        await self.rerecord_lost_steps(below=step)  # `step` itself is recorded, with its acks, next
        if step:
            await self.record_step(step, state.groups, state.entry_ids)
        log.info("resumed from checkpoint step %d at version %d", step, step)
        if latest == step:
            await self._announce(await self.store.manifest(latest))  # the last life may have died before this
            return step
        async with self._staged(step, state.groups, state.entry_ids) as staged:
            await self._publish(step, staged / "weights")
        return step

    async def rerecord_lost_steps(self, below: int) -> None:
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

    @contextlib.asynccontextmanager
    async def _staged(self, version: int, groups: dict[str, int], entry_ids: list[str]) -> AsyncIterator[Path]:
        """A commit's files written in line (start-up and resume) in the store's staging dir."""
        async with self.store.staging() as directory:
            await asyncio.to_thread(self.stage(version, groups, entry_ids).write, directory, self.actor.tokenizer)
            yield directory

    async def _publish(self, version: int, weights_dir: Path) -> None:
        """Shards, manifest, LATEST (inside the store), then the weights event."""
        manifest = await self.store.publish(
            version, version, weights_dir, precision_id=self.precision_id,
            dtype=published_dtype(self.config.precision.numerics()), parent=version - 1 if version else None,
            is_checkpoint=version % self.config.trainer.checkpoint_every == 0, quantization_plan=self.plan)
        await self._announce(manifest)
        await self.store.retain(self.config.store.keep_last)

    async def _announce(self, manifest: Manifest) -> None:
        await self.bus.publish(WEIGHTS, WeightsPublishedEvent(
            job_id=self.config.job_id, version=manifest.version, step=manifest.step,
            manifest_uri=self.store.uri(manifest.version), shard_sha256={s.key: s.sha256 for s in manifest.shards},
            size_bytes=sum(s.size_bytes for s in manifest.shards), precision_id=manifest.precision_id),
            maxlen=WEIGHTS_KEPT)

    def _load_checkpoint(self, directory: Path) -> TrainerState:
        try:
            state = msgspec.json.decode((directory / STATE_FILE).read_bytes(), type=TrainerState)
        except (OSError, msgspec.DecodeError) as exc:  # unknown fields too: nothing loads half-understood
            raise RuntimeError(f"trainer state {directory / STATE_FILE}: {exc}") from None
        model, optimizer = self.actor.model, self.actor.optimizer
        load_state(model, load_file(str(directory / "model.safetensors")))
        tensors = load_file(str(directory / "optimizer.safetensors"))  # fresh, writable tensors: no clone needed
        for name, param in model.named_parameters():
            if f"{name}::step" in tensors:
                optimizer.state[param] = {
                    "step": tensors[f"{name}::step"].reshape(()),  # AdamW keeps its step count on the host
                    "exp_avg": tensors[f"{name}::exp_avg"].view_as(param).to(param.device),
                    "exp_avg_sq": tensors[f"{name}::exp_avg_sq"].view_as(param).to(param.device),
                }
        torch.set_rng_state(tensors["rng::torch"])
        return state

    async def _emit(self, version: int, stats: dict[str, float]) -> None:
        await self.bus.publish(METRICS, MetricsEvent(
            job_id=self.config.job_id, service="trainer", values={name: float(value) for name, value in stats.items()},
            step=version))
