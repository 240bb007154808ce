"""The staleness spec on a real Redis: the trainer waits rather than let a slow group pass eta_hard, masks and counts
what is still beyond it, and a sequence interrupted by a weight update carries both versions with the new weights'
log-probs after the swap."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from job_harness import hold_streams
from service_harness import build_model, job_config, publish_version, scored_sample, stop, until

from jetroll.functions.scoring import job_tasks
from jetroll.services.launch.local import Launcher
from jetroll.services.rollout.worker import RolloutWorker
from jetroll.services.trainer.intake import GROUP, STREAM, Intake
from jetroll.services.trainer.sections import TrainerSections
from jetroll.services.trainer.trainer import Trainer
from jetroll.shared.engine.engine import Engine
from jetroll.shared.model.checkpoint import load_pretrained
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import (
    Array,
    GroupEvent,
    ScoredEvent,
    TrajectoryEvent,
    WeightsPublishedEvent,
    decode,
)
from jetroll.shared.protocol.in_flight import InFlightIndex
from jetroll.shared.protocol.ledger import Ledger
from jetroll.shared.protocol.topology import IN_FLIGHT
from jetroll.shared.protocol.validate import EventLimits
from jetroll.shared.rl.admission import in_flight_slack
from jetroll.shared.store import setup_store

pytestmark = pytest.mark.integration

async def trainer_rows(bus: RedisBus) -> dict[int, dict[str, float]]:
    """The trainer's metrics so far, by step."""
    rows: dict[int, dict[str, float]] = {}
    for _, fields in await bus.redis.xrange(bus.key("metrics")):
        event = decode(fields[b"e"])
        if event.service == "trainer":
            rows.setdefault(event.step, {}).update(event.values)
    return rows


@pytest.mark.parametrize("engine", ["real", "timing"])
def test_trainer_waits_for_a_slow_group_and_masks_what_is_beyond_eta_hard(
    engine: str, model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """eta = 1, so eta_hard = 2; B = 1 group of 2. The test plays controller and reward router.

    g1 (v_adm 0) is slow: one sample arrives at once, the other only after the trainer has reached v2 and must wait
    for it, though g4 is complete; its late sample straddles v0..v2 and trains with lag 2, unmasked. g6 (v_adm 2)
    carries tokens of a worker stuck on v0: trained at v5, those lag 5 and are masked and counted.
    """
    config = job_config(model_dir, tmp_path, trainer={"engine": engine, "timing_step_s": 0.02, "max_steps": 6,
                                                      "groups_per_step": 1, "group_size": 2},
                        staleness={"max_staleness": 1})
    job = config.job_id

    async def scenario() -> tuple[dict[int, dict[str, float]], float, int]:
        bus = RedisBus(redis_url, job)
        trainer = Trainer(config, job_tasks(config), bus, setup_store(config.store, job, tmp_path), "trainer")
        task = asyncio.create_task(trainer.run())
        try:
            await bus.redis.zadd(bus.key(IN_FLIGHT), {"g1": 0, "g2": 0, "g3": 1, "g4": 1, "g5": 2, "g6": 2})

            async def publish_once_at(version: int, events: list[ScoredEvent]) -> None:
                """As rollout would: a token of version v exists only once the trainer has published v."""
                async def reached() -> bool:
                    latest = await trainer.store.latest()
                    return latest is not None and latest >= version

                await until(reached, task, f"v{version}")
                await bus.publish_many("traj:scored", events)

            await publish_once_at(0, [scored_sample(job, "g1", 0, 0, [0, 0]), *(scored_sample(job, "g2", i, 0, [0, 0])
                                                                          for i in range(2))])
            await publish_once_at(1, [scored_sample(job, "g3", i, 1, [1, 1]) for i in range(2)])
            await publish_once_at(2, [scored_sample(job, "g4", i, 1, [1, 2]) for i in range(2)])
            async def stalled() -> bool:  # B groups at hand (g4), but the step must wait for g1
                return trainer.intake.stale_wait_s >= 0.4

            await until(stalled, task, "a stale wait for g1")
            version_while_waiting = trainer.version
            await bus.publish("traj:scored", scored_sample(job, "g1", 1, 0, [0, 0, 1, 1, 2, 2]))
            await publish_once_at(4, [*(scored_sample(job, "g5", i, 2, [2, 3, 4]) for i in range(2)),
                                      *(scored_sample(job, "g6", i, 2, [0, 0, 3, 4]) for i in range(2))])
            await asyncio.wait_for(task, timeout=60)
            return await trainer_rows(bus), version_while_waiting, await bus.redis.zcard(bus.key(IN_FLIGHT))
        finally:
            await stop(task)
            await bus.close()

    rows, version_while_waiting, num_in_flight = asyncio.run(scenario())
    assert version_while_waiting == 2  # g4 was complete, but g1 had to come first
    client = redis.Redis.from_url(redis_url)
    try:
        ledger = {k.decode(): json.loads(v) for k, v in client.hgetall(f"jetroll:{job}:ledger").items()}
    finally:
        client.close()
    assert {g: o["step"] for g, o in ledger.items()} == {"g2": 1, "g3": 2, "g1": 3, "g4": 4, "g5": 5, "g6": 6}
    assert num_in_flight == 0
    assert rows[3]["stale_wait_s"] >= 0.4 and rows[3]["lag_max"] == 2 and rows[3]["mixed_version_frac"] == 0.5
    for step in (1, 2, 3, 4, 5):
        assert rows[step]["lag_max"] <= 2 and rows[step]["stale_masked_tokens"] == 0
    assert rows[6]["lag_max"] == 5 and rows[6]["stale_masked_tokens"] == 4
    assert rows[6]["stale_masked_frac"] == pytest.approx(4 / 8)
    if engine == "real":  # the loss saw only the tokens within eta_hard
        assert rows[6]["num_tokens"] == rows[6]["num_policy_tokens"] - 4
        assert rows[3]["num_tokens"] == rows[3]["num_policy_tokens"]


@pytest.mark.parametrize("count_eta", [None, 3], ids=["the-jobs-bound", "its-own-bound"])
def test_a_slow_task_with_its_own_staleness_bound_neither_stalls_the_trainer_nor_loses_its_tokens(
    count_eta: int | None, model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """eta = 1 (eta_hard 2), B = 1 group of 2; the test plays controller (admitting through the in-flight index as
    the controller does) and reward router. count's g1 (v_adm 0) is slow: one sample at once, the other once the
    trainer has reached v4 or has stood still for half a second. arithmetic's g2..g6 come one version apart.
    Under the job's bound the trainer stalls at v2 for g1 (as above); with `max_staleness: 3` (eta_hard 6) it trains
    the arithmetic groups meanwhile and g1 at step 5 with its lag-4 tokens kept."""
    config = job_config(model_dir, tmp_path, trainer={"max_steps": 6, "groups_per_step": 1, "group_size": 2,
                                                      "task_quotas": False},  # oldest v_adm first, whatever the task
                        staleness={"max_staleness": 1},
                        tasks=[{"name": "arithmetic"}, {"name": "count", "max_staleness": count_eta}])
    job = config.job_id
    tasks = {"g1": "count", **{f"g{i}": "arithmetic" for i in range(2, 7)}}
    v_adm = {"g1": 0, **{f"g{i}": i - 2 for i in range(2, 7)}}

    async def scenario() -> tuple[dict[int, dict[str, float]], int]:
        bus = RedisBus(redis_url, job)
        trainer = Trainer(config, job_tasks(config), bus, setup_store(config.store, job, tmp_path), "trainer")
        task = asyncio.create_task(trainer.run())
        arithmetic: asyncio.Task[None] | None = None
        try:
            admitted = [GroupEvent(job_id=job, group_id=g, task=t, pool="default", prompt="", answer="",
                                   prompt_ids=Array.of([5, 6, 7], "<i4"), group_size=2, max_new_tokens=8,
                                   v_adm=v_adm[g]) for g, t in tasks.items()]
            await InFlightIndex(bus, in_flight_slack(config)).admit(admitted, num_admitted=0, num_indices=6)

            async def reached(version: int) -> bool:
                latest = await trainer.store.latest()
                return latest is not None and latest >= version

            async def publish_arithmetic() -> None:
                for group in [g for g, t in tasks.items() if t == "arithmetic"]:
                    version = v_adm[group]  # a token of version v exists only once v is published
                    await until(lambda v=version: reached(v), task, f"v{version}")
                    await bus.publish_many("traj:scored", [scored_sample(job, group, i, version, [version] * 2)
                                                           for i in range(2)])

            await until(lambda: reached(0), task, "v0")
            await bus.publish("traj:scored", scored_sample(job, "g1", 0, 0, [0, 0], task="count"))
            arithmetic = asyncio.create_task(publish_arithmetic())
            async def stalled_or_past() -> bool:  # the bounds part at v2: stall for g1, or train on past it
                return trainer.version >= 4 or trainer.intake.stale_wait_s >= 0.4

            await until(stalled_or_past, task, "a stale wait for g1, or v4")
            version_when_late = trainer.version
            await bus.publish("traj:scored", scored_sample(job, "g1", 1, 0, [0, 0, 1, 1, 2, 2], task="count"))
            await asyncio.wait_for(task, timeout=60)
            return await trainer_rows(bus), version_when_late
        finally:
            if arithmetic is not None:
                await stop(arithmetic)
            await stop(task)
            await bus.close()

    rows, version_when_late = asyncio.run(scenario())
    client = redis.Redis.from_url(redis_url)
    try:
        ledger = {k.decode(): json.loads(v)["step"] for k, v in client.hgetall(f"jetroll:{job}:ledger").items()}
    finally:
        client.close()
    if count_eta is None:
        assert version_when_late == 2 and ledger["g1"] == 3  # stalled at v2 for g1, which trained at lag 2
        assert rows[3]["stale_wait_s"] >= 0.4 and rows[3]["lag_max/count"] == 2
    else:
        assert version_when_late == 4 and ledger["g1"] == 5  # the arithmetic groups trained meanwhile
        assert all(row["stale_wait_s"] == 0 for row in rows.values())
        assert rows[5]["lag_max/count"] == 4 and rows[5]["stale_masked_tokens"] == 0  # past the job's 2, kept
        assert rows[5]["num_tokens"] == rows[5]["num_policy_tokens"]
    assert sorted(ledger.values()) == [1, 2, 3, 4, 5, 6]


def test_bound_holds_end_to_end(model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """A whole job on the timing models with heavy-tailed lengths (cv 3), eta = 1: slow trajectories straddle
    several updates. Recounted from the scored stream and the ledger, no trained token lags more than eta_hard
    unless the trainer counted it as masked."""
    eta_hard = 2
    config = job_config(
        model_dir, tmp_path,
        rollout={"engine": "timing", "max_batch": 16, "compile": False,
                 "timing": {"mean_tokens": 64, "cv": 3.0, "token_time_s": 0.002, "seed": 3}},
        trainer={"engine": "timing", "timing_step_s": 0.05, "max_steps": 24, "groups_per_step": 4, "group_size": 4},
        staleness={"max_staleness": 1}, reward={"num_workers": 2})
    hold_streams(redis_url, config.job_id, "traj:scored")
    launcher = Launcher(config, tmp_path, redis_url, is_console=False)
    try:
        assert launcher.supervise() == 0
    finally:
        launcher.stop()
    client = redis.Redis.from_url(redis_url)
    try:
        key = f"jetroll:{config.job_id}"
        ledger = {k.decode(): json.loads(v) for k, v in client.hgetall(f"{key}:ledger").items()}
        trajectories = {}
        for _, fields in client.xrange(f"{key}:traj:scored"):
            traj = decode(fields[b"e"]).trajectory
            trajectories.setdefault(traj.traj_id, traj)  # the trainer keeps the first copy
        assert client.zcard(f"{key}:{IN_FLIGHT}") == 0
    finally:
        client.close()
    rows = {int(r["step"]): r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == list(range(1, 25))
    max_versions = 0
    for group, outcome in ledger.items():
        consumed_at = outcome["step"] - 1  # a step trains at the version before it
        for traj_id in (f"{group}:{sample}" for sample in range(outcome["num_samples"])):
            v_tok = trajectories[traj_id].v_tok.numpy()
            max_versions = max(max_versions, len(set(v_tok.tolist())))
            beyond = int((consumed_at - v_tok > eta_hard).sum())
            rows[outcome["step"]]["recount"] = rows[outcome["step"]].get("recount", 0) + beyond
    for step, row in rows.items():
        assert row["stale_masked_tokens"] == row.get("recount", 0), step
        assert row["lag_max"] <= eta_hard or row["stale_masked_tokens"] > 0, step
    assert max_versions >= 3  # a slow trajectory really crossed several updates
    assert sum(r["stale_wait_s"] for r in rows.values()) > 0  # and the trainer waited for it


@pytest.mark.parametrize("recompute_kv", [True, False], ids=["recompute", "kept-kv"])
def test_interrupted_sequence_carries_both_versions_and_new_logprobs(
    model_dir: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recompute_kv: bool
) -> None:
    """The real rollout worker on a real Redis and store: v1 is published while a group decodes. With
    `rollout.recompute_kv_on_swap`, every token's behaviour log-prob must be a full forward of the weights its v_tok
    names: the old ones before the swap, the new ones (KV cache recomputed) after it. Without it, an interrupted
    sequence's v1 tokens were computed over v0's keys: no longer a full forward of v1."""
    # count32: a task whose sample budget (159 tokens) admits the long group below
    config = job_config(model_dir, tmp_path, rollout={"max_batch": 8, "max_seq_len": 160, "compile": False,
                                                      "recompute_kv_on_swap": recompute_kv},
                        trainer={"group_size": 8}, tasks=[{"name": "count32"}])
    job = config.job_id
    new_dir = tmp_path / "v1-src"
    build_model(new_dir, seed=1, weight_scale=10.0)
    step = Engine.step

    def slow_step(engine: Engine) -> list:
        time.sleep(0.003)  # a few ms per token, so v1 lands mid-sequence
        return step(engine)

    monkeypatch.setattr(Engine, "step", slow_step)
    tokenizer = build_char_tokenizer()

    async def publish(store: Any, bus: RedisBus, version: int, src: Path) -> None:
        manifest = await publish_version(store, config, version, src)
        await bus.publish("weights", WeightsPublishedEvent(
            job_id=job, version=version, step=version, manifest_uri=store.uri(version),
            shard_sha256={s.key: s.sha256 for s in manifest.shards}, size_bytes=0, precision_id=manifest.precision_id))

    async def scenario() -> list[TrajectoryEvent]:
        bus = RedisBus(redis_url, job)
        store = setup_store(config.store, job, tmp_path)
        await publish(store, bus, 0, model_dir)
        await bus.ensure_group("groups:default", "rollout")
        await bus.ensure_group("traj:raw", "reward")  # the reward router's group, for the worker's backpressure
        worker = asyncio.create_task(RolloutWorker(config, config.build_tasks(), bus, store, "rollout-0").run())
        try:
            prompt = "12*34="
            await bus.publish("groups:default", GroupEvent(
                job_id=job, group_id="g0000001", task="count32", pool="default", prompt=prompt,
                prompt_ids=Array.of(tokenizer.encode(prompt), "<i4"), answer="408", group_size=8,
                max_new_tokens=120, v_adm=0))
            async def is_delivered() -> bool:
                info = await bus.redis.xinfo_groups(bus.key("groups:default"))
                return info[0]["last-delivered-id"] != b"0-0"

            async def is_emitted() -> bool:
                return await bus.redis.xlen(bus.key("traj:raw")) >= 8

            await until(is_delivered, worker, "the worker takes the group")
            await publish(store, bus, 1, new_dir)
            await until(is_emitted, worker, "8 trajectories")
            events = [decode(fields[b"e"]) for _, fields in await bus.redis.xrange(bus.key("traj:raw"))]
            return [e for e in events if isinstance(e, TrajectoryEvent)]
        finally:
            await stop(worker)
            await bus.close()

    trajectories = asyncio.run(scenario())
    models = {0: load_pretrained(model_dir)[0], 1: load_pretrained(new_dir)[0]}
    num_interrupted, new_vs_old, kept_vs_full = 0, [], []
    for traj in trajectories:
        v_tok = traj.v_tok.numpy().tolist()
        num_old = v_tok.count(0)
        assert v_tok == [0] * num_old + [1] * (len(v_tok) - num_old)
        is_interrupted = 0 < num_old < len(v_tok)
        num_interrupted += is_interrupted
        prompt, completion = traj.prompt_ids.numpy().tolist(), traj.completion_ids.numpy().tolist()
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            full = {v: torch.log_softmax(m(ids)[0, len(prompt) - 1:-1].float(), -1) for v, m in models.items()}
        mu = torch.from_numpy(traj.behavior_logprobs.numpy().copy())
        for t, (token, version) in enumerate(zip(completion, v_tok, strict=True)):
            if version == 1:
                new_vs_old.append(abs(full[0][t, token].item() - full[1][t, token].item()))
            if is_interrupted and version == 1 and not recompute_kv:
                kept_vs_full.append(abs(mu[t].item() - full[1][t, token].item()))
                continue
            assert mu[t].item() == pytest.approx(full[version][t, token].item(), abs=1e-4), (traj.traj_id, t)
    assert num_interrupted >= 1
    assert sum(new_vs_old) / len(new_vs_old) > 0.1  # the check tells the two versions apart
    if not recompute_kv:  # the kept keys change what v1 computed
        assert sum(kept_vs_full) / len(kept_vs_full) > 0.05, kept_vs_full


def test_a_group_in_the_commit_running_in_the_background_is_not_waited_for(model_dir: Path, redis_url: str,
                                                                            tmp_path: Path) -> None:
    """eta_hard = 2, B = 1. g1 trained at v0; its commit runs in the background, so the in-flight index still holds
    it (the commit removes it when it records the step). At v3, g1 is past eta_hard by the index's reckoning, but it
    is trained: the intake hands over the complete g2 at once instead of waiting on g1 until the commit lands."""
    config = job_config(model_dir, tmp_path, trainer={"max_steps": 6, "groups_per_step": 1, "group_size": 2},
                        staleness={"max_staleness": 1})
    job = config.job_id
    version = 0

    async def scenario() -> tuple[list[str], list[str], float]:
        bus = RedisBus(redis_url, job)
        tasks = config.build_tasks()
        limits = EventLimits.of(config, tasks, 64)
        intake = Intake(TrainerSections.of(config, tasks), bus, "trainer", Ledger(bus), limits, lambda: version)
        try:
            await bus.ensure_group(STREAM, GROUP)
            await bus.redis.zadd(bus.key(IN_FLIGHT), {"g1": 0, "g2": 1})
            await bus.publish_many(STREAM, [scored_sample(job, "g1", i, 0, [0, 0]) for i in range(2)])
            intake.start()
            first = await asyncio.wait_for(intake.next_groups(None), timeout=10)
            nonlocal version
            version = 3  # steps 1 and 2 trained other groups; g1's record is still to come
            await bus.publish_many(STREAM, [scored_sample(job, "g2", i, 1, [1, 1]) for i in range(2)])
            second = await asyncio.wait_for(intake.next_groups(None), timeout=10)
            return [g.group_id for g in first], [g.group_id for g in second], intake.stale_wait_s
        finally:
            await intake.stop()
            await bus.close()

    first, second, stale_wait_s = asyncio.run(scenario())
    assert (first, second, stale_wait_s) == (["g1"], ["g2"], 0.0)
