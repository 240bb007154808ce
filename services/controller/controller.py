"""The controller: admits groups under the staleness bound, aggregates metrics, evaluates, summarises."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from jetroll.services.controller.progress import MetricsBook, ProgressView, plot_curves
from jetroll.services.controller.routing import route_tasks
from jetroll.services.controller.sinks import MetricSinks
from jetroll.shared.config.job import JobConfig
from jetroll.shared.evaluate import evaluate
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.checkpoint import load_pretrained
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.dead_letters import DeadLetterAlarm, DeadLetters, dead_letter_counts
from jetroll.shared.protocol.events import AnyEvent, Array, GroupEvent, MetricsEvent, WeightsPublishedEvent
from jetroll.shared.protocol.ids import group_id
from jetroll.shared.protocol.in_flight import InFlightIndex
from jetroll.shared.protocol.ledger import Ledger, LedgerTotals
from jetroll.shared.protocol.topology import METRICS, TRAJ_RAW, TRAJ_SCORED, WEIGHTS, Stream, groups_stream
from jetroll.shared.protocol.validate import (
    EventLimits,
    check_metrics,
    check_weights,
    expecting,
)
from jetroll.shared.rl.admission import Admission, admission_window, in_flight_caps, in_flight_slack
from jetroll.shared.store.base import WeightStore, WeightStoreError
from jetroll.shared.tasks.dataset import DatasetTask
from jetroll.shared.tasks.registry import TaskSet

log = logging.getLogger("jetroll.controller")

# the controller alone tails metrics: it trims them behind what it has read, keeping this much for a restarted life
# to rebuild the step in progress (written rows come back from metrics.jsonl, drops from the ledger)
METRICS_KEEP_S = 30.0
METRICS_TRIM_EVERY_S = 5.0


class Controller:
    def __init__(self, config: JobConfig, tasks: TaskSet, bus: RedisBus, store: WeightStore, run_dir: Path) -> None:
        self.config = config
        self.tasks = tasks
        self.bus = bus
        self.store = store
        self.run_dir = run_dir
        trainer = config.trainer
        self.admission = Admission(trainer.groups_per_step, admission_window(config), trainer.max_steps,
                                   task_weights={t.name: t.weight for t in config.tasks},
                                   task_caps=in_flight_caps(config) if trainer.task_quotas else None)
        self.task_names = [t.name for t in config.tasks]
        self.task_of_group: dict[str, str] = {}  # admitted groups, for the per-task in-flight caps
        assert config.model.path, "the launcher resolves model.path before services start"
        self.tokenizer = load_tokenizer(config.model.path)
        self.prompts = PromptFormat.of(config.model, self.tokenizer)
        self.limits = EventLimits.of(config, tasks, self.tokenizer.vocab_size)
        self.is_metric = expecting(MetricsEvent, lambda event: check_metrics(event, self.limits))
        self.book = MetricsBook(run_dir)
        self.sinks = MetricSinks(config, run_dir)
        self.ledger = Ledger(bus)
        self.dead_letters = DeadLetters(bus)
        self.in_flight = InFlightIndex(bus, in_flight_slack(config))
        self.version = 0
        self.pool_of_task = route_tasks(config.rollout, tasks, self.task_names, self.tokenizer)
        self.datasets = {name: task.rows for name in self.task_names
                         if isinstance(task := tasks[name], DatasetTask)}
        log.info("task -> rollout pool: %s; pool labels: %s", self.pool_of_task,
                 {pool.name: pool.labels for pool in config.rollout.pools})

    async def run(self) -> dict:
        started = time.time()
        # from the newest dead letter on: an earlier life's are not this window's
        alarm = DeadLetterAlarm(self.dead_letters, self.config.redis.dlq_alarm_min, await self.dead_letters.newest_id(),
                                (await self.ledger.totals()).num_samples_recorded)
        await self._restore_admitted()
        while (latest := await self.store.latest()) is None:
            await asyncio.sleep(0.2)
        accuracy_before = self._first_eval() or await self._evaluate(latest)
        weights_id = metrics_id = "0-0"
        trimmed_at = heard_at = time.monotonic()
        with ProgressView(self.book, self.config.trainer.max_steps, self.task_names) as view:
            while self.version < self.config.trainer.max_steps:
                await self._admit()
                # a step whose metrics are in is about to publish its weights: wait on those, not on more metrics
                is_publishing = bool(self.book.rows) and self.book.rows[-1]["step"] > self.version
                weights_id, events = await self.bus.tail(WEIGHTS, weights_id, block_ms=1000 if is_publishing else 0,
                                                         check=self._check_weights)
                published = [e.version for e in events if isinstance(e, WeightsPublishedEvent)]
                if published:
                    heard_at = time.monotonic()
                elif time.monotonic() - heard_at > self.config.store.poll_interval_s:
                    heard_at = time.monotonic()
                    published = await self._poll_latest()
                # new weights: admit at once, without waiting for more metrics
                metrics_id, events = await self.bus.tail(METRICS, metrics_id, block_ms=0 if published else 100,
                                                         count=1000, check=self.is_metric)
                for event in events:
                    if isinstance(event, MetricsEvent) and (row := self.book.add(event)) is not None:
                        self.sinks.write_row(row)
                        view.stream_lags = await self._stream_lags()
                        view.update(row)
                if time.monotonic() - trimmed_at >= METRICS_TRIM_EVERY_S:
                    await self.bus.trim_before(METRICS, metrics_id, METRICS_KEEP_S)
                    trimmed_at = time.monotonic()
                # evaluate a version only once its weights event says it is in the store
                every = self.config.eval.every_steps
                for version in published:
                    if every and version % every == 0 and self.version < version < self.config.trainer.max_steps:
                        try:
                            await self._evaluate(version)
                        except WeightStoreError as exc:  # retention may already have removed it
                            log.warning("skipping the held-out eval of v%d: %s", version, exc)
                        await self._report_memory(version)
                    self.version = view.version = max(self.version, version)
                # the trainer's ledger, not the metrics stream, counts drops: it outlives any retention
                totals = await self.ledger.totals()
                self.admission.num_dropped = view.num_dropped = totals.num_dropped
                if alarm.is_due():
                    await alarm.check(totals.num_samples_recorded)
                view.update()
        accuracy_after = await self._evaluate(self.version)
        memory = await self._report_memory(self.version)
        summary = self._summary(accuracy_before, accuracy_after, time.time() - started, await self.ledger.totals(),
                                memory) | {"dead_letters": dead_letter_counts(await self.dead_letters.read())}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_curves(self.book, self.task_names, self.run_dir / "curves.png")
        self.sinks.close()
        return summary

    async def _poll_latest(self) -> list[int]:
        """LATEST, if it is past the version heard of: a weights event can be lost with Redis' last second of
        writes, the final version's too (after which the trainer is done and says nothing more)."""
        try:
            latest = await self.store.latest()
        except WeightStoreError as exc:  # the store is down: the next poll tries again
            log.warning("polling the store's LATEST failed: %s", exc)
            return []
        return [latest] if latest is not None and latest > self.version else []

    async def _check_weights(self, event: AnyEvent) -> str | None:
        """An announcement the controller may act on: of this job's store, and naming the shards the store holds
        for that version. A version past LATEST that the store lacks was never published; one at or below it may
        have been retained away since, and only moves nothing forward."""
        if not isinstance(event, WeightsPublishedEvent):
            return f"expected a WeightsPublishedEvent, got a {type(event).__name__}"
        if reason := check_weights(event, self.limits, self.store.uri(event.version)):
            return reason
        try:
            manifest = await self.store.manifest(event.version)
        except WeightStoreError as exc:
            latest = await self.store.latest()
            return None if latest is not None and event.version <= latest else f"{exc} (LATEST is v{latest})"
        if {shard.key: shard.sha256 for shard in manifest.shards} != event.shard_sha256:
            return f"its shards are not those the store holds for version {event.version}"
        return None

    async def _restore_admitted(self) -> None:
        """A restarted controller goes on counting (and drawing) from what earlier lives admitted."""
        self.admission.num_admitted = await self.in_flight.num_admitted()

    async def _admit(self) -> None:
        num = self.admission.num_allowed(self.version)
        if num == 0:
            return
        in_flight = await self._in_flight_by_task()
        is_sync = self.config.staleness.mode == "sync"
        events = []
        first = self.admission.num_admitted + 1
        for index in range(first, first + num):
            drawn = self.admission.draw(self.tasks, self.config.seed, index, in_flight)
            if drawn is None:  # every task is at its in-flight cap
                break
            task, problem = drawn
            in_flight[task.name] = in_flight.get(task.name, 0) + 1
            events.append(GroupEvent(
                job_id=self.config.job_id, group_id=group_id(index), task=task.name,
                pool=self.pool_of_task[task.name], prompt=problem.prompt,
                prompt_ids=Array.of(self.prompts.ids(problem), "<i4"),
                answer=problem.answer, group_size=self.config.trainer.group_size,
                max_new_tokens=self.config.rollout.sample_budget(task.max_new_tokens), v_adm=self.version,
                min_version=self.version if is_sync else 0))
            self.task_of_group[events[-1].group_id] = task.name
        if not events:
            return
        # a machine crash can lose Redis' last second, admissions included, while the store keeps the steps that
        # trained those groups (a restarted trainer re-records them): count such an index, but never run it again
        recorded = await self.ledger.recorded({e.group_id for e in events})
        if recorded:
            log.warning("not admitting %d groups again: the ledger holds them (%s...)", len(recorded), min(recorded))
        # the counter lives in Redis, counted with the groups, so a restarted controller never reuses a group_id
        await self.in_flight.admit([e for e in events if e.group_id not in recorded], num_admitted=first - 1,
                                   num_indices=len(events))
        self.admission.num_admitted += len(events)

    async def _in_flight_by_task(self) -> dict[str, int]:
        """Admitted groups not yet trained or dropped, by task (the trainer takes them out of the index)."""
        if self.admission.task_caps is None or len(self.task_names) == 1:
            return {}
        live = await self.in_flight.members()
        self.task_of_group = {i: task for i, task in self.task_of_group.items() if i in live}
        counts: dict[str, int] = {}
        for task in self.task_of_group.values():
            counts[task] = counts.get(task, 0) + 1
        return counts

    async def _evaluate(self, version: int) -> dict[str, float]:
        if not self.config.eval.num_problems:
            return {}
        directory = await self.store.fetch(version)

        def run() -> dict[str, float]:
            model, tokenizer = load_pretrained(directory, self.config.precision.numerics())
            return evaluate(model, tokenizer, self.tasks, self.task_names, self.config.eval.num_problems,
                            prompts=self.prompts)

        accuracy = await asyncio.to_thread(run)
        self.book.evals.append({"version": version, **accuracy})
        self.sinks.write_eval(version, accuracy)
        with (self.run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps({"version": version, **accuracy}) + "\n")
        log.info("held-out accuracy at v%d: %s", version, accuracy)
        return accuracy

    async def _report_memory(self, version: int) -> dict:
        """Redis's used memory and this job's keys by size, with the evals: a line of redis_memory.jsonl."""
        memory = await self.bus.memory()
        with (self.run_dir / "redis_memory.jsonl").open("a") as f:
            f.write(json.dumps({"version": version, **memory}) + "\n")
        log.info("redis at v%d: used_memory %d bytes, the job's keys %d", version, memory["used_memory_bytes"],
                 memory["job_keys_bytes"])
        return memory

    def _first_eval(self) -> dict[str, float] | None:
        """The base model's accuracy, if an earlier life of this controller measured it."""
        path = self.run_dir / "eval.jsonl"
        if not path.exists() or not path.read_text().strip():
            return None
        first = json.loads(path.read_text().splitlines()[0])
        self.book.evals.append(first)
        return {k: v for k, v in first.items() if k != "version"}

    async def _stream_lags(self) -> dict[str, int]:
        lags = {}
        streams: list[Stream] = [*(groups_stream(pool.name) for pool in self.config.rollout.pools), TRAJ_RAW,
                                 TRAJ_SCORED]
        for stream in streams:
            try:
                lags[stream.name] = await self.bus.lag(stream.name, stream.group)
            except ValueError:  # the consumer group is not created yet
                lags[stream.name] = 0
        return lags

    def _summary(self, before: dict[str, float], after: dict[str, float], wall_s: float, ledger: LedgerTotals,
                 memory: dict) -> dict:
        mismatch, coverage = self.book.mismatch()
        return {
            "job_id": self.config.job_id,
            "steps": self.version,
            "accuracy_before": sum(before.values()) / len(before) if before else None,
            "accuracy_after": sum(after.values()) / len(after) if after else None,
            "accuracy_before_per_task": before,
            "accuracy_after_per_task": after,
            # what each task was scored on: a dataset's held-out split may be shorter than eval.num_problems
            "num_eval_problems": {name: len(self.tasks[name].heldout(self.config.eval.num_problems))
                                  for name in self.task_names},
            "rollout_tokens_per_s": self.book.rollout_tokens_per_s(),
            "mismatch_mean_abs_logprob": mismatch,
            "mismatch_coverage": coverage,
            "groups_admitted": self.admission.num_admitted,
            "groups_dropped": ledger.num_dropped,
            "groups_trained_by_task": {
                k.split("/", 1)[1]: int(v) for k, v in self.book.totals.items() if k.startswith("groups/")},
            "dropped_by_status": ledger.dropped_by_status(),
            "precision": self.config.precision.mode,
            "staleness": self.config.staleness.model_dump(),
            "redis_memory": memory,
            "datasets": {name: {"files": [str(f) for f in rows.files], "train_rows": len(rows.train),
                                "heldout_rows": len(rows.heldout), "bad_rows": len(rows.bad),
                                "first_bad_rows": [str(row) for row in rows.bad[:5]]}
                         for name, rows in self.datasets.items()},
            "wall_time_s": wall_s,
        }
