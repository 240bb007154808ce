"""Exactly-once training across trainer crashes: a trainer that dies at any point of a step's commit, and a new life
that resumes from the store, end where a trainer that never died ends, to the bit (a real Trainer on a real Redis and
a local store; the crash is an exception raised right after the named call, the new life a new Trainer)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import scored
from factories import trajectory as make_trajectory
from trainer_harness import flat_parameters, make_trainer

from jetroll.services.trainer.trainer import Trainer
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.protocol.events import ScoredEvent
from jetroll.shared.protocol.ledger import Ledger
from jetroll.shared.protocol.topology import TRAJ_SCORED

pytestmark = pytest.mark.integration

PROMPTS = ("12+34=", "7-5=", "98-9=", "5+5=")
REWARDS = ((1.0, 0.0, 1.0, 0.0), (0.0, 1.0, 1.0, 0.0), (1.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.5))
SECTIONS: dict[str, Any] = {"trainer": {"groups_per_step": 2, "group_size": 4, "lr": 1e-2, "lr_schedule": "constant",
                                        "max_steps": 2, "checkpoint_every": 100},
                            "store": {"keep_checkpoints": 1},
                            # a new life takes the dead one's entries over at once, not after an idle time
                            "redis": {"claim_idle_ms": 3_600_000}}
# (object, attribute) of the call right after which the first life dies: from inside the step to before the announce;
# `_read_latest` is inside the publish, after the version's manifest and before LATEST moves to it
CRASH_POINTS = [("trainer", "_step"), ("store", "save_checkpoint"), ("store", "record_step"), ("ledger", "record"),
                ("bus", "ack"), ("store", "_read_latest"), ("store", "publish")]


class Crash(Exception):
    """Stands in for a kill -9 right after a call: nothing after it runs."""


def scored_sample(job_id: str, group: int, sample: int) -> ScoredEvent:
    tokenizer = build_char_tokenizer()
    completion = tokenizer.encode(str(10 + group + sample))
    traj = make_trajectory(f"g{group}:{sample}", completion, job_id=job_id, prompt=PROMPTS[group], answer="0",
                           prompt_ids=tokenizer.encode(PROMPTS[group]), group_size=4)
    return scored(traj, REWARDS[group][sample])


async def publish_groups(trainer: Trainer, groups: range) -> None:
    await trainer.bus.ensure_group(TRAJ_SCORED.name, TRAJ_SCORED.group)
    for group in groups:
        for sample in range(4):
            await trainer.bus.publish(TRAJ_SCORED.name, scored_sample(trainer.config.job_id, group, sample))


def crash_after(owner: Any, name: str, armed: Callable[[], bool]) -> None:
    call = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = call(*args, **kwargs)
        if not asyncio.iscoroutine(result):
            if armed():
                raise Crash(name)
            return result

        async def then_crash() -> Any:
            value = await result
            if armed():
                raise Crash(name)
            return value
        return then_crash()

    setattr(owner, name, wrapped)


def run_life(make: Callable[[], Trainer], groups: range, crash: tuple[str, str] | None = None) -> Trainer:
    """One life of a trainer, fed `groups`; with `crash`, it dies right after that call in its first step."""
    trainer = make()
    if crash is not None:
        owner, name = crash
        # v0's state and publish go through the same calls: die in the first step only
        crash_after(trainer if owner == "trainer" else getattr(trainer, owner), name,
                    lambda: name == "_step" or trainer.version >= 1)

    async def body() -> None:
        await publish_groups(trainer, groups)
        try:
            await trainer.run()
        finally:
            await trainer.bus.close()

    if crash is None:
        asyncio.run(body())
    else:
        with pytest.raises(Crash):
            asyncio.run(body())
    return trainer


def audit(trainer: Trainer) -> tuple[list[tuple[int, dict[str, int]]], dict[str, Any], int, int | None]:
    """(step records, ledger outcomes, scored entries not yet acked, LATEST) of the trainer's job."""
    async def body() -> tuple[list[tuple[int, dict[str, int]]], dict[str, Any], int, int | None]:
        records = [(r.version, r.groups) for r in await trainer.store.step_records()]
        outcomes = {g: (o.step, o.status) for g, o in (await Ledger(trainer.bus).outcomes()).items()}
        lag = await trainer.bus.lag(TRAJ_SCORED.name, TRAJ_SCORED.group)
        latest = await trainer.store.latest()
        await trainer.bus.close()
        return records, outcomes, lag, latest
    return asyncio.run(body())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("crash", CRASH_POINTS, ids=[f"{o}.{n}" for o, n in CRASH_POINTS])
def test_a_trainer_dying_anywhere_in_a_step_resumes_exactly_once(
    crash: tuple[str, str], model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None  # noqa: F811
) -> None:
    job_id = f"c{uuid.uuid4().hex[:8]}"

    def make() -> Trainer:
        return make_trainer(model_dir, tmp_path / "crashed", redis_url, job_id=job_id, **SECTIONS)

    run_life(make, range(2), crash)
    second = run_life(make, range(2, 4))  # a new life: g2 and g3 arrive for the second step
    reference = run_life(lambda: make_trainer(model_dir, tmp_path / "clean", redis_url, **SECTIONS), range(4))

    assert second.version == 2
    assert torch.equal(flat_parameters(second), flat_parameters(reference))  # no update lost, none made twice
    records, outcomes, lag, latest = audit(make())
    assert records == [(1, {"g0": 4, "g1": 4}), (2, {"g2": 4, "g3": 4})]  # each group trained once, in one step
    assert outcomes == {"g0": (1, "trained"), "g1": (1, "trained"), "g2": (2, "trained"), "g3": (2, "trained")}
    assert lag == 0 and latest == 2
    checkpoints = sorted(p.name for p in (tmp_path / "crashed" / "store" / job_id / "checkpoints").iterdir())
    assert checkpoints == ["step00000000", "step00000002"]  # keep_checkpoints 1, and the milestones (every 100)


def test_a_trainer_refuses_a_store_whose_newest_version_has_no_state(
        model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None) -> None:  # noqa: F811
    """Versions past the newest state that verifies would name weights no trainer can continue from."""
    job_id = f"c{uuid.uuid4().hex[:8]}"

    def make() -> Trainer:
        return make_trainer(model_dir, tmp_path, redis_url, job_id=job_id, **SECTIONS)

    run_life(make, range(4))
    store = tmp_path / "store" / job_id
    (store / "checkpoints" / "step00000002" / "optimizer.safetensors").write_bytes(b"torn")
    trainer = make()

    async def body() -> None:
        try:
            trainer.version = await trainer.committer.resume_or_publish_base()
        finally:
            await trainer.bus.close()

    with pytest.raises(RuntimeError, match="LATEST is version 2, but its newest trainer state that verifies is"):
        asyncio.run(body())


@pytest.mark.parametrize("mode", ["fp32", "fp8_unified"])
def test_a_commit_stores_each_distinct_file_once(
        mode: str, model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None) -> None:  # noqa: F811
    """The version's files that equal its checkpoint's are one file in the local store: the tokenizer's always, the
    model's when the masters are what rollout computes with (fp32). Nothing staged stays behind."""
    job_id = f"c{uuid.uuid4().hex[:8]}"
    run_life(lambda: make_trainer(model_dir, tmp_path, redis_url, job_id=job_id, precision={"mode": mode},
                                  **SECTIONS), range(4))
    store = tmp_path / "store" / job_id
    version, checkpoint = store / "weights" / "v00000002", store / "checkpoints" / "step00000002"

    def same_file(name: str) -> bool:
        return (version / name).stat().st_ino == (checkpoint / name).stat().st_ino

    assert same_file("tokenizer.json") and same_file("tokenizer_config.json")
    assert same_file("model.safetensors") == same_file("config.json") == (mode == "fp32")
    assert list((store / ".staging").iterdir()) == []
