"""Where a service's memory goes, phase by phase: `python scripts/service_memory.py trainer|rollout [LAYERS]` builds
the 0.5B-shape model (configs/bench_qwen2.5_0.5b.yaml, LAYERS of its 24) with random weights and prepares the process
as its service does. `trainer`: the job's real Trainer runs three steps of 2 groups x 4 samples, each followed by the
commit's staging. `rollout`: the rollout worker's engine decodes 8 samples, swaps to a version in the published
layout (bf16 block linears) in the middle, and finishes them. It prints the process's RSS after each phase and its
high-water mark during it (sampled every 20 ms). No Redis is needed. Run from the repository root."""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file

from jetroll.bench.shape import CONFIG, with_layers
from jetroll.functions.scoring import job_tasks
from jetroll.services.launch.entrypoints import prepare_process
from jetroll.services.trainer.trainer import Trainer
from jetroll.shared.config.job import JobConfig, load_config, validate_config
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.model.checkpoint import WEIGHTS, load_pretrained, save_pretrained
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import Array, ScoredEvent, TrajectoryEvent
from jetroll.shared.rl.batch import GroupBuffer, PendingGroup
from jetroll.shared.store import setup_store
from jetroll.shared.warm_start import ensure_base_model

GIB = 1024**3


class Rss:
    """This process's RSS, and its high-water mark since the last `phase`."""

    def __init__(self) -> None:
        self.peak = self.now()
        self.started = time.perf_counter()
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(0.02)

    def phase(self, name: str) -> None:
        print(f"{name:32s} RSS {self.now() / GIB:6.2f} GiB, peak during {self.peak / GIB:6.2f} GiB, "
              f"{time.perf_counter() - self.started:6.1f} s", flush=True)
        self.peak, self.started = self.now(), time.perf_counter()


def scored_events(trainer: Trainer, job_id: str) -> list[ScoredEvent]:
    generator = torch.Generator().manual_seed(0)
    events = []
    for row in range(8):
        group, sample = divmod(row, 4)
        prompt = trainer.actor.tokenizer.encode(f"{100 + group}+23=")
        completion = torch.randint(10, 400, (12,), generator=generator).tolist()
        traj = TrajectoryEvent(
            job_id=job_id, traj_id=f"g{group}:{sample}", group_id=f"g{group}", sample=sample, task="arithmetic",
            pool="default", prompt="", answer="0", prompt_ids=Array.of(prompt, "<i4"),
            completion_ids=Array.of(completion, "<i4"), loss_mask=Array.of([1] * 12, "<u1"),
            behavior_logprobs=Array.of([-5.0] * 12, "<f4"), v_tok=Array.of([0] * 12, "<i4"), v_adm=0, group_size=4,
            temperature=1.0, top_p=1.0, precision_id="p", finish_reason="length")
        events.append(ScoredEvent(job_id=job_id, trajectory=traj, reward=float(sample % 2), status="ok", attempts=1,
                                  backend="local", latency_s=0.0))
    return events


def groups_of(events: list[ScoredEvent]) -> list[PendingGroup]:
    buffer = GroupBuffer()
    for i, event in enumerate(events):
        buffer.add(f"0-{i}", event)
    groups = buffer.take_oldest(2)
    assert groups is not None
    return groups


def rollout(config: JobConfig, path: Path, rss: Rss) -> None:
    model, tokenizer = load_pretrained(path, config.precision.numerics())
    model.share_inference_masters()  # as the rollout worker does
    rss.phase("rollout: model")
    engine = Engine(model, tokenizer.eos_id, 8, 64, seed=0)
    rss.phase("engine")
    save_pretrained(model, None, path.parent / "v1", publish=config.precision.numerics())
    published = load_file(str(path.parent / "v1" / WEIGHTS))  # as the worker reads a version from the store
    rss.phase("next version read")
    requests = [Request(f"r{i}", tokenizer.encode(f"{i}+1="), 24, temperature=1.0, ignore_eos=True) for i in range(8)]
    engine.add(requests)
    for _ in range(8):
        engine.step()
    rss.phase("decode")
    engine.swap_weights(published, 1)
    del published
    rss.phase("swap")
    while engine.has_work:
        engine.step()
    rss.phase("decode after the swap")


def main(service: str, layers: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="jetroll-service-memory-"))
    config = load_config(CONFIG, [f"model.path={with_layers(work / 'model', layers)}",
                                  f"model.cache_dir={work / 'cache'}"])
    tasks = job_tasks(config)
    path = ensure_base_model(config.model, tasks, progress=False)  # in a child's memory would be fairer; it is small
    prepare_process(service, config)  # as `jetroll trainer` and `jetroll rollout` do
    rss = Rss()
    if service == "rollout":
        rollout(config, path, rss)
        shutil.rmtree(work)
        return
    tree = config.model_dump(mode="json")
    tree["model"].update(path=str(path), init="pretrained")
    tree["store"]["root"] = str(work / "store")
    tree["job_id"] = f"m{uuid.uuid4().hex[:6]}"
    config = validate_config(tree)
    trainer = Trainer(config, tasks, RedisBus("redis://127.0.0.1:1/0", config.job_id),
                      setup_store(config.store, config.job_id, work / "run"), "trainer")
    rss.phase("trainer: policy, reference")
    events = scored_events(trainer, config.job_id)
    for step in range(1, 4):
        trainer._step(groups_of(events))
        rss.phase(f"step {step}")
        shutil.rmtree(trainer.committer.stage(trainer.version, {"g0": 4, "g1": 4}, ["0-0"]))
        rss.phase(f"staging {step}")
    shutil.rmtree(work)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("trainer", "rollout"):
        sys.exit("usage: python scripts/service_memory.py trainer|rollout [LAYERS]")
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 24)
