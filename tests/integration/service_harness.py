"""Services run in process on a tiny model: the model, a job config for it, scored samples, and waiting on and
stopping a service's task. The model's fixture (`model_dir`) is in conftest.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from factories import NO_MISMATCH_GATES, scored
from factories import trajectory as make_trajectory
from helpers import ended, wait_until_async

from jetroll.shared.config.job import JobConfig, validate_config
from jetroll.shared.config.model import ModelConfig
from jetroll.shared.model.checkpoint import quantization_plan, read_args, save_pretrained
from jetroll.shared.model.init import init_weights, model_args
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.protocol.events import ScoredEvent
from jetroll.shared.store.base import Manifest, WeightStore

TINY = ModelConfig(num_layers=1, intermediate_size=256)


def build_model(directory: Path, seed: int, weight_scale: float = 1.0) -> None:
    """A random tiny model; scaling every matrix up makes attention (so the KV cache) and the logits matter."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    model = CausalLM(model_args(TINY, tokenizer))
    init_weights(model)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(weight_scale)
    save_pretrained(model, tokenizer, directory)


async def publish_version(store: WeightStore, config: JobConfig, version: int, src: Path) -> Manifest:
    """`src` (fp32, as `build_model` writes it) as version `version` of an fp32 job, published as the trainer does:
    with the quantization plan and precision id of the job's precision."""
    plan = quantization_plan(read_args(src)[0], config.precision.numerics())
    return await store.publish(version, version, src, precision_id=config.precision.precision_id(plan.digest),
                               dtype="float32", parent=version - 1 if version else None, quantization_plan=plan)


def job_config(model_dir: Path, run_dir: Path, **sections: Any) -> JobConfig:
    tree: dict[str, Any] = {"job_id": f"s{uuid.uuid4().hex[:8]}", "eval": {"num_problems": 1},
                            "model": {**TINY.model_dump(), "path": str(model_dir)},
                            "store": {"root": str(run_dir / "store")}, "precision": {"mismatch": NO_MISMATCH_GATES}}
    for name, fields in sections.items():
        tree[name] = {**tree.get(name, {}), **fields} if isinstance(fields, dict) else fields
    return validate_config(tree)


def scored_sample(job_id: str, group: str, sample: int, v_adm: int, v_tok: list[int],
                  task: str = "arithmetic") -> ScoredEvent:
    n = len(v_tok)
    traj = make_trajectory(f"{group}:{sample}", [8 + (i + sample) % 10 for i in range(n)], job_id=job_id,
                           prompt_ids=[5, 6, 7], behavior_logprobs=-3.0, v_tok=v_tok, v_adm=v_adm, task=task)
    return scored(traj, float(sample))


async def until(predicate: Callable[[], Awaitable[bool]], task: asyncio.Task[None], what: str,
                timeout_s: float = 60.0) -> None:
    """Poll `predicate` while `task` runs; a dead task raises its error, a timeout names what never happened."""
    await wait_until_async(predicate, what, timeout_s, interval_s=0.005, gone=ended(task))


async def stop(task: asyncio.Task[None]) -> None:
    """Cancel until it ends: on Python 3.11, asyncio.wait_for drops a cancellation that races the end of what it
    waits for (a service's own waits, and redis-py's socket writes under a socket timeout), and the service would
    run on."""
    for _ in range(50):
        task.cancel()
        if (await asyncio.wait({task}, timeout=0.2))[0]:
            return
