"""The trainer: complete groups in, one optimizer step and one published weight version out, per step.

The loop is this file; the intake (`intake.py`) brings the groups, the actor (`actor.py`) steps on them, the
precision mismatch sampler (`mismatch.py`) hooks around each step, and the commit (`commit.py`) makes each step
durable and publishes its weights while the next step computes. Each part reads only the trainer's own config
(`sections.py`), resolved here from the job's."""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from jetroll.services.trainer.actor import Actor
from jetroll.services.trainer.commit import Committer
from jetroll.services.trainer.intake import GROUP, STREAM, Intake
from jetroll.services.trainer.mismatch import Measure, MismatchSampler
from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.config.job import JobConfig
from jetroll.shared.engine.factory import modelled_step
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.ledger import Ledger
from jetroll.shared.protocol.validate import EventLimits
from jetroll.shared.rl.batch import PendingGroup
from jetroll.shared.rl.staleness import staleness_stats
from jetroll.shared.store.base import WeightStore
from jetroll.shared.tasks.registry import TaskSet

log = logging.getLogger("jetroll.trainer")


class Clock:
    """Named instants of one cycle, read back as the seconds between two of them."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def between(self, start: str, end: str) -> float:
        return self.marks[end] - self.marks[start]


class Trainer:
    def __init__(self, job: JobConfig, tasks: TaskSet, bus: RedisBus, store: WeightStore, consumer: str) -> None:
        """The job's values are resolved here, at the trainer's entry: its parts read only `TrainerSections`."""
        self.config = config = TrainerSections.of(job, tasks)
        self.bus = bus
        self.store = store
        self.ledger = Ledger(bus)
        self.version = 0
        self.commit_task: asyncio.Task[None] | None = None
        self.publish_s = 0.0
        self.actor = Actor(config)
        self.mismatch = MismatchSampler(self.actor.model, config)
        self.train_step = modelled_step(config.trainer, lambda: self.publish_s) or self._actor_step
        limits = EventLimits.of(job, tasks, self.actor.model.args.vocab_size)
        self.intake = Intake(config, bus, consumer, self.ledger, limits, lambda: self.version)
        self.committer = Committer(config, bus, store, self.ledger, self.actor, self.intake.release)

    async def run(self) -> None:
        torch.manual_seed(self.config.seed)
        await self.bus.ensure_group(STREAM, GROUP)
        self.version = await self.committer.resume_or_publish_base()
        # scored trajectories are buffered all along, steps included: the next step's groups are at hand when it starts
        self.intake.start()
        try:
            await self._train()
        finally:
            await self.intake.stop()
        log.info("trainer done at version %d", self.version)

    async def _train(self) -> None:
        """Step, then commit the step in the background while the next one computes (the commit is mostly I/O);
        commits run one at a time, in version order. A step's precision mismatch is scored while the trainer waits
        for its next groups, never beside a step, and joins the step's metrics in its commit."""
        clock = Clock()
        clock.mark("cycle")
        measuring: asyncio.Task[dict[str, float]] | None = None
        while self.version < self.config.trainer.max_steps:
            if await self.bus.server_run_id() != self.committer.redis_run_id:  # Redis restarted under a live trainer
                await self._last_commit()
                await self.committer.rerecord_lost_steps(below=self.version + 1)
            clock.mark("wait")
            groups = await self.intake.next_groups(self.commit_task)
            clock.mark("groups")
            if measuring is not None:
                await asyncio.wait({measuring})  # its commit reads its outcome
            clock.mark("step")
            stats, measure = await asyncio.to_thread(self._step, groups)
            self.version += 1
            clock.mark("stage")
            trained, entry_ids = {g.group_id: len(g.samples) for g in groups}, [i for g in groups for i in g.entry_ids]
            staged = await asyncio.to_thread(self.committer.stage, self.version, trained, entry_ids)
            clock.mark("commit_wait")
            await self._last_commit()
            clock.mark("now")
            self.publish_s = clock.between("stage", "now")
            # a cycle runs from one step's start to the next: waiting for groups, the step, staging its commit
            stats |= {"step_time_s": clock.between("step", "stage"), "stage_s": clock.between("stage", "commit_wait"),
                      "commit_wait_s": clock.between("commit_wait", "now"),
                      "trainer_wait_s": clock.between("wait", "step"),
                      # of that wait, the part spent on the last step's mismatch after the groups were at hand
                      "mismatch_wait_s": clock.between("groups", "step"),
                      "trainer_idle_frac": clock.between("wait", "step") / clock.between("cycle", "now"),
                      "stale_wait_s": self.intake.stale_wait_s}
            clock.mark("cycle")
            measuring = asyncio.create_task(asyncio.to_thread(measure))
            self.commit_task = asyncio.create_task(self.committer.commit(self.version, staged, trained, entry_ids,
                                                                         stats, measuring))
        await self._last_commit()

    async def _last_commit(self) -> None:
        if self.commit_task is not None:
            await self.commit_task
            self.commit_task = None

    def _actor_step(self, groups: list[PendingGroup], version: int) -> tuple[dict[str, float], Measure]:
        """The actor's step, and the precision mismatch sampler's hooks around it: it keeps the weights the step
        starts from, and returns the call that measures the step's mismatch (the commit makes it, off the critical
        path)."""
        self.mismatch.before_step(version)
        stats, batch, policy = self.actor.step(groups, version)
        return stats, self.mismatch.after_step(batch, policy, version)

    def _step(self, groups: list[PendingGroup]) -> tuple[dict[str, float], Measure]:
        """One optimizer step (or what the config's trainer engine models of it) and its staleness stats; and the
        call that measures its precision mismatch."""
        stats, measure = self.train_step(groups, self.version)
        trajectories = [e.trajectory for g in groups for e in g.events]
        per_task = {f"groups/{task}": float(sum(g.task == task for g in groups)) for task in self.config.task_names}
        stats |= per_task | staleness_stats(trajectories, self.version, self.config.eta_hard)
        return stats, measure
