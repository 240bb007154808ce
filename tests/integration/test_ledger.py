"""The compact ledger on a real Redis: old outcomes fold into totals and are still known recorded, so a re-delivered
copy of a trained group is acked untrained; a restarted controller counts drops from it."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from service_harness import job_config, publish_version, scored_sample, stop, until

from jetroll.functions.scoring import job_tasks
from jetroll.services.controller.controller import Controller
from jetroll.services.trainer.trainer import Trainer
from jetroll.shared.config.job import JobConfig
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import Array, GroupEvent, WeightsPublishedEvent, decode
from jetroll.shared.protocol.ids import admission_index, group_id
from jetroll.shared.protocol.in_flight import InFlightIndex
from jetroll.shared.protocol.ledger import Ledger, Outcome
from jetroll.shared.protocol.topology import IN_FLIGHT
from jetroll.shared.store import setup_store
from jetroll.shared.store.base import Manifest, WeightStore

pytestmark = pytest.mark.integration


def test_group_ids_carry_their_admission_index() -> None:
    assert group_id(12) == "g0000012" and admission_index("g0000012") == 12
    assert admission_index("g12") is None and admission_index("c0") is None  # never folded: known by the hash alone


def test_old_outcomes_fold_into_totals_and_stay_recorded(any_redis_url: str) -> None:
    async def main() -> None:
        bus = RedisBus(any_redis_url, f"l{uuid.uuid4().hex[:8]}")
        try:
            ledger = Ledger(bus)
            g1, g2, g3, g4, g5 = (group_id(i) for i in range(1, 6))
            await bus.redis.zadd(bus.key(IN_FLIGHT), {g: 0 for g in (g1, g2, g3, g4, g5)})
            await ledger.record({g3: Outcome(1, "trained", 4), g5: Outcome(1, "dropped:timeout", 3)}, keep_groups=2)
            assert set(await ledger.outcomes()) == {g3, g5}  # above a prefix that has not moved
            assert (await ledger.totals()).prefix == 1
            await ledger.record({g1: Outcome(2, "trained", 4), g2: Outcome(2, "trained", 4)}, keep_groups=2)
            # the prefix passed g1..g3; g1 is more than 2 behind it, so only the totals hold it
            assert await ledger.outcomes() == {g2: Outcome(2, "trained", 4), g3: Outcome(1, "trained", 4),
                                               g5: Outcome(1, "dropped:timeout", 3)}
            assert await ledger.recorded({g1, g2, g3, g4, g5, "g1"}) == {g1, g2, g3, g5}
            # a second record of a recorded group, folded or kept, changes nothing
            await ledger.record({g1: Outcome(3, "dropped:error", 1), g3: Outcome(3, "trained", 4)}, keep_groups=2)
            await ledger.record({g4: Outcome(3, "trained", 4), "c0": Outcome(3, "trained", 4)}, keep_groups=2)
            totals = await ledger.totals()
            assert totals.num_groups == {"trained": 5, "dropped:timeout": 1}
            assert totals.num_samples == {"trained": 20, "dropped:timeout": 3}
            assert totals.prefix == 6 and totals.max_step == 3
            assert totals.num_dropped == 1 and totals.dropped_by_status() == {"timeout": 1}
            assert set(await ledger.outcomes()) == {g4, g5, "c0"}  # an id of another form is never folded
            assert await ledger.recorded({g1, g2, g3, g4, g5, group_id(6), "c0"}) == {g1, g2, g3, g4, g5, "c0"}
            assert await bus.redis.zcard(bus.key(IN_FLIGHT)) == 0
        finally:
            await bus.close()

    asyncio.run(main())


def test_admissions_ride_out_dropped_connections_and_count_once(redis_url: str) -> None:  # noqa: F811
    """Another client keeps killing the controller's connections (what a Redis restart does) while it admits:
    a drop while the counter is watched, or before EXEC's reply, neither fails the admission nor applies it twice."""
    num_admissions = 60

    async def main() -> None:
        job = f"a{uuid.uuid4().hex[:8]}"
        bus, killer = RedisBus(redis_url, job), RedisBus(redis_url, job)
        index = InFlightIndex(bus)

        async def kill_forever() -> None:
            while True:
                await killer.redis.client_kill_filter(_type="normal", skipme=True)
                await asyncio.sleep(0.005)

        killing = asyncio.create_task(kill_forever())
        try:
            for i in range(num_admissions):
                event = GroupEvent(job_id=job, group_id=group_id(i), task="t", pool="default", prompt="1+1=",
                                   prompt_ids=Array.of([1, 2], "<i4"), answer="2", group_size=4, max_new_tokens=8,
                                   v_adm=0)
                await index.admit([event], num_admitted=i, num_indices=1)
        finally:
            killing.cancel()
        try:
            assert await index.num_admitted() == num_admissions
            assert await bus.redis.xlen(bus.key("groups:default")) == num_admissions  # each published once
            assert len(await index.members()) == num_admissions
            with pytest.raises(RuntimeError, match="another writer"):  # a real second writer is still refused
                await index.admit([], num_admitted=num_admissions - 1, num_indices=1)
        finally:
            await bus.close()
            await killer.close()

    asyncio.run(main())


def test_trainer_acks_a_redelivered_copy_of_a_folded_group(model_dir: Path, redis_url: str,  # noqa: F811
                                                            tmp_path: Path) -> None:
    """g1 trains at step 1 and is folded (the ledger keeps 1 outcome) by step 2. A second copy of it (a reclaim
    re-emitted its samples) arrives with g3: the oldest v_adm goes first, so a retrained g1 would take step 3."""
    config = job_config(model_dir, tmp_path, trainer={"engine": "timing", "timing_step_s": 0.02, "max_steps": 3,
                                                      "groups_per_step": 1, "group_size": 2},
                        redis={"ledger_keep_groups": 1})
    job = config.job_id
    g1, g2, g3 = (group_id(i) for i in range(1, 4))

    async def scenario() -> tuple[dict[str, Outcome], dict[str, int], int, int]:
        bus = RedisBus(redis_url, job)
        trainer = Trainer(config, job_tasks(config), bus, setup_store(config.store, job, tmp_path), "trainer")
        task = asyncio.create_task(trainer.run())
        try:
            await bus.publish_many("traj:scored", [scored_sample(job, g, i, 0, [0, 0])
                                                   for g in (g1, g2) for i in range(2)])

            async def is_at_v2() -> bool:  # step 2 committed: its commit runs beside the next step
                return bool(await trainer.ledger.recorded({g2}))

            await until(is_at_v2, task, "step 2")
            assert await trainer.ledger.outcomes() == {g2: Outcome(2, "trained", 2)}
            await bus.publish_many("traj:scored", [scored_sample(job, g, i, v, [v, v]) for g, v in ((g1, 0), (g3, 1))
                                                   for i in range(2)])
            await asyncio.wait_for(task, timeout=60)
            totals = await trainer.ledger.totals()
            return await trainer.ledger.outcomes(), totals.num_groups, totals.prefix, await bus.lag("traj:scored",
                                                                                                    "trainer")
        finally:
            await stop(task)
            await bus.close()

    outcomes, num_groups, prefix, lag = asyncio.run(scenario())
    assert outcomes == {g3: Outcome(3, "trained", 2)}
    assert num_groups == {"trained": 3} and prefix == 4
    assert lag == 0  # the copy was acked


async def publish_versions(store: WeightStore, config: JobConfig, weights: Path, count: int) -> Manifest:
    """Versions 0..count-1 of `weights` in the store, each the child of the one before; the last's manifest."""
    for version in range(count):
        manifest = await publish_version(store, config, version, weights)
    return manifest


def test_a_restarted_controller_counts_drops_from_the_ledger(model_dir: Path, redis_url: str,  # noqa: F811
                                                             tmp_path: Path) -> None:
    """An earlier life admitted 12 groups; the trainer trained 4 at step 1 and dropped 3; no metrics are left (the
    stream's retention). B = 4, eta = 2: at v1 the new life may have (1 + 2 + 1) * 4 = 16 live groups, so it admits
    16 - (12 - 3) = 7 (4 if it did not know of the drops)."""
    config = job_config(model_dir, tmp_path, trainer={"max_steps": 10, "groups_per_step": 4, "group_size": 2},
                        staleness={"max_staleness": 2})
    job = config.job_id
    (tmp_path / "eval.jsonl").write_text(json.dumps({"version": 0, "arithmetic": 0.5}) + "\n")  # the base's eval

    async def scenario() -> int:
        bus = RedisBus(redis_url, job)
        store = setup_store(config.store, job, tmp_path)
        manifest = await publish_versions(store, config, model_dir, 2)
        await bus.publish("weights", WeightsPublishedEvent(
            job_id=job, version=1, step=1, manifest_uri=store.uri(1),
            shard_sha256={s.key: s.sha256 for s in manifest.shards}, size_bytes=0, precision_id=manifest.precision_id))
        await bus.redis.set(bus.key("num_admitted"), 12)
        earlier = {group_id(i): Outcome(1, "trained" if i <= 4 else "dropped:timeout", 2) for i in range(1, 8)}
        await Ledger(bus).record(earlier, keep_groups=0)
        task = asyncio.create_task(Controller(config, job_tasks(config), bus, store, tmp_path).run())
        try:
            async def num_admitted() -> int:
                return int(await bus.redis.get(bus.key("num_admitted")))

            async def is_full() -> bool:
                return await num_admitted() >= 16

            await until(is_full, task, "the admissions")
            await asyncio.sleep(0.5)  # a few more rounds of the controller's loop
            return await num_admitted()
        finally:
            await stop(task)
            await bus.close()

    assert asyncio.run(scenario()) == 12 + 7


def test_a_controller_counts_but_never_publishes_an_index_the_ledger_holds(model_dir: Path, redis_url: str,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    """A Redis that lost its last second rolled the admission counter back under groups the trainer has trained
    (and re-recorded from the store). B = 4, eta = 2: v0 admits 12 indices; g2 and g3 are in the ledger, so 10
    groups are published, and the counter covers all 12."""
    config = job_config(model_dir, tmp_path, trainer={"max_steps": 10, "groups_per_step": 4, "group_size": 2},
                        staleness={"max_staleness": 2})
    job = config.job_id

    async def scenario() -> tuple[list[str], int, set[str]]:
        bus = RedisBus(redis_url, job)
        try:
            await Ledger(bus).record({group_id(i): Outcome(1, "trained", 2) for i in (2, 3)}, keep_groups=0)
            controller = Controller(config, job_tasks(config), bus, setup_store(config.store, job, tmp_path), tmp_path)
            await controller._restore_admitted()
            await controller._admit()
            events = [decode(fields[b"e"]) for _, fields in await bus.redis.xrange(bus.key("groups:default"))]
            return ([e.group_id for e in events], await InFlightIndex(bus).num_admitted(),
                    await InFlightIndex(bus).members())
        finally:
            await bus.close()

    published, num_admitted, in_flight = asyncio.run(scenario())
    expected = [group_id(i) for i in range(1, 13) if i not in (2, 3)]
    assert published == expected and num_admitted == 12 and in_flight == set(expected)


def test_a_controller_hears_of_a_version_whose_weights_event_was_lost(model_dir: Path, redis_url: str,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    """The store holds versions 0-2 and LATEST says 2, but no weights event was ever announced (lost with Redis'
    last second): the controller polls LATEST, and the 2-step job ends, evaluated at v2."""
    config = job_config(model_dir, tmp_path, trainer={"max_steps": 2, "groups_per_step": 4, "group_size": 2},
                        store={"poll_interval_s": 0.2})
    job = config.job_id
    (tmp_path / "eval.jsonl").write_text(json.dumps({"version": 0, "arithmetic": 0.5}) + "\n")  # the base's eval

    async def scenario() -> dict:
        bus = RedisBus(redis_url, job)
        store = setup_store(config.store, job, tmp_path)
        await publish_versions(store, config, model_dir, 3)
        try:
            return await asyncio.wait_for(Controller(config, job_tasks(config), bus, store, tmp_path).run(), timeout=60)
        finally:
            await bus.close()

    summary = asyncio.run(scenario())
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2], evals
    assert summary["accuracy_after"] == evals[-1]["arithmetic"]
