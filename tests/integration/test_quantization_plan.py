"""A rollout worker refuses weights whose quantization plan, or whose tensors, differ from its own plan: it
dead-letters the version with the first difference and fails the job (exit 65 through the launcher), at start-up
and mid-run. Real worker, real Redis, the local store; the versions are published as the trainer publishes them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from service_harness import job_config, publish_version, stop, until

from jetroll.services.rollout.worker import RolloutWorker
from jetroll.shared.config.job import JobConfig
from jetroll.shared.errors import JobFailedError
from jetroll.shared.model.checkpoint import (
    load_pretrained,
    pretrained_tensors,
    quantization_plan,
    read_args,
    save_pretrained,
    write_pretrained,
)
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.dead_letters import DeadLetters
from jetroll.shared.store import setup_store
from jetroll.shared.store.base import WeightStore

pytestmark = pytest.mark.integration


async def publish_fp8(store: WeightStore, config: JobConfig, version: int, model_dir: Path, out: Path) -> None:
    """`model_dir`'s model as the trainer publishes it under `config`'s precision: the rollout formats, the plan."""
    model, tokenizer = load_pretrained(model_dir)
    save_pretrained(model, tokenizer, out, publish=config.precision.numerics())
    plan = quantization_plan(model.args, config.precision.numerics())
    await store.publish(version, version, out, precision_id=config.precision.precision_id(plan.digest),
                        dtype="fp8", parent=None, quantization_plan=plan)


def run_worker(config: JobConfig, redis_url: str, tmp_path: Path, publish: Any,
               later: Any = None) -> tuple[str, list]:
    """Run a worker for `config`'s job after `publish(store)`; `later(store)` runs once it serves. Returns the
    error it failed with and the job's dead letters."""
    async def scenario() -> tuple[str, list]:
        bus = RedisBus(redis_url, config.job_id)
        store = setup_store(config.store, config.job_id, tmp_path)
        await publish(store)
        worker = RolloutWorker(config, config.build_tasks(), bus, store, "rollout-0")
        task = asyncio.create_task(worker.run())
        try:
            if later is not None:
                async def is_serving() -> bool:
                    return worker.engine is not None

                await until(is_serving, task, "the worker serves v0")
                await later(store)
            with pytest.raises(JobFailedError) as failed:
                await asyncio.wait_for(task, timeout=60)
            return str(failed.value), await DeadLetters(bus).read()
        finally:
            await stop(task)
            await bus.close()

    return asyncio.run(scenario())


@pytest.mark.parametrize("engine", ["jetroll", "vllm"])
def test_an_exclusion_on_one_side_only_is_refused_at_start_up(engine: str, model_dir: Path, redis_url: str,
                                                              tmp_path: Path) -> None:
    """The trainer publishes every block linear in FP8; the worker's precision keeps gate/up in bf16. The check runs
    before either engine sees the weights."""
    trainer_side = job_config(model_dir, tmp_path, precision={"mode": "fp8_unified"})
    rollout_side = job_config(model_dir, tmp_path, job_id=trainer_side.job_id, rollout={"engine": engine},
                              precision={"mode": "fp8_unified", "high_precision": ["gate_proj", "up_proj"]})
    error, dead = run_worker(rollout_side, redis_url, tmp_path,
                             lambda store: publish_fp8(store, trainer_side, 0, model_dir, tmp_path / "v0"))
    difference = ("model.layers.0.mlp.gate_proj.weight is bf16 in rollout-0's plan and e4m3[128x128] in version 0's")
    assert error == f"rollout-0 ({engine}) refuses weights v0: {difference}"
    assert [(d["stream"], d["entry_id"], d["reason"]) for d in dead] == [("weights", "v0", error)]
    assert b'"quantization_plan"' in dead[0]["payload"]  # the refused manifest, for the post-mortem


def test_a_version_whose_tensors_break_its_own_plan_is_refused_mid_run(model_dir: Path, redis_url: str,
                                                                       tmp_path: Path) -> None:
    """v0 serves; v1's manifest carries the job's plan, but one of its linears was written in bf16."""
    config = job_config(model_dir, tmp_path, rollout={"compile": False}, store={"poll_interval_s": 0.1})

    async def publish_bad_v1(store: WeightStore) -> None:
        model, tokenizer = load_pretrained(model_dir)
        tensors, hf_config = pretrained_tensors(model)
        name = "model.layers.0.self_attn.o_proj.weight"
        tensors[name] = tensors[name].to(torch.bfloat16)
        write_pretrained(tmp_path / "v1", tensors, hf_config, tokenizer)
        await publish_version(store, config, 1, tmp_path / "v1")

    error, dead = run_worker(config, redis_url, tmp_path, lambda store: publish_version(store, config, 0, model_dir),
                             later=publish_bad_v1)
    assert error == ("rollout-0 (jetroll) refuses weights v1: model.layers.0.self_attn.o_proj.weight is "
                     "torch.bfloat16, and its plan says fp32")
    assert [d["reason"] for d in dead] == [error]


def test_a_version_without_a_plan_is_refused(model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    config = job_config(model_dir, tmp_path)
    plan = quantization_plan(read_args(model_dir)[0], config.precision.numerics())

    async def publish_planless(store: WeightStore) -> None:
        await store.publish(0, 0, model_dir, precision_id=config.precision.precision_id(plan.digest),
                            dtype="float32", parent=None)

    error, _ = run_worker(config, redis_url, tmp_path, publish_planless)
    assert error == "rollout-0 (jetroll) refuses weights v0: its manifest carries no quantization plan"
