"""One trainer rank of a test: the actor sharded over `world` gloo ranks steps on its share of recorded batches, and
rank 0 steps a one-rank actor on the whole batches beside it, then writes what the two did (run_ranks.json)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from factories import NO_MISMATCH_GATES, scored, trajectory
from trainer_harness import TINY

from jetroll.functions.scoring import job_tasks
from jetroll.services.trainer.actor import Actor
from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.config.job import validate_config
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.rl.batch import GroupBuffer, PendingGroup, collate
from jetroll.shared.rl.passes import proximal_pass
from jetroll.shared.rl.ranks import ONE_RANK, join_ranks, split_by_cost

GROUPS, GROUP_SIZE = 4, 4


def recorded_batches(steps: int, seed: int) -> list[list[PendingGroup]]:
    """`steps` batches of GROUPS groups: answers of 1 to 12 tokens, rewards 0 or 1 (a group may have no signal)."""
    rng, tokenizer = random.Random(seed), build_char_tokenizer()
    batches = []
    for step in range(steps):
        buffer = GroupBuffer()
        for group in range(GROUPS):
            prompt = f"{rng.randrange(100)}+{rng.randrange(100)}="
            for sample in range(GROUP_SIZE):
                answer = tokenizer.encode("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12))))
                traj = trajectory(f"s{step}g{group}:{sample}", answer, prompt=prompt,
                                  prompt_ids=tokenizer.encode(prompt), behavior_logprobs=-2.5, group_size=GROUP_SIZE,
                                  v_tok=step)
                buffer.add(f"{step}-{group}-{sample}", scored(traj, float(rng.random() < 0.5)))
        taken = buffer.take_oldest(GROUPS)
        assert taken is not None
        batches.append(taken)
    return batches


def group_cost(group: PendingGroup) -> float:
    return float(sum(len(e.trajectory.prompt_ids.numpy()) + len(e.trajectory.completion_ids.numpy())
                     for e in group.events))


def full_parameters(actor: Actor) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective when sharded)."""
    return {name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
            for name, param in actor.model.named_parameters()}


def relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(a[n] - b[n]).flatten() for n in a]).norm()
    return float(diff / torch.cat([b[n].flatten() for n in a]).norm())


def capture_gradients(actor: Actor, into: list[dict[str, torch.Tensor]]) -> None:
    """Record the reduced gradients of each optimizer step before the step (Adam's scale invariance would hide a
    missing or doubled 1/N in the weights)."""
    step = actor.optimizer.step

    def recorded(*args: Any, **kwargs: Any) -> Any:
        into.append({name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for name, p in actor.model.named_parameters()})
        return step(*args, **kwargs)

    actor.optimizer.step = recorded  # type: ignore[method-assign]


def run_rank(rank: int, world: int, port: int, model_dir: str, out: str, steps: int, sections: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tree: dict[str, Any] = {"job_id": "ranks", "model": {**TINY.model_dump(), "path": model_dir},
                            "trainer": {"group_size": GROUP_SIZE, "groups_per_step": GROUPS,
                                        "lr": 1e-3, **sections.get("trainer", {})},
                            "precision": {"mismatch": NO_MISMATCH_GATES, **sections.get("precision", {})},
                            "staleness": {"mode": "async", "max_staleness": 2}}
    config = validate_config(tree)
    trainer_sections = TrainerSections.of(config, job_tasks(config))
    ranks = join_ranks(world, torch.device("cpu"), timeout_s=120)
    actor = Actor(trainer_sections, ranks)
    solo = Actor(trainer_sections, ONE_RANK) if rank == 0 else None
    sharded_grads: list[dict[str, torch.Tensor]] = []
    solo_grads: list[dict[str, torch.Tensor]] = []
    capture_gradients(actor, sharded_grads)
    if solo is not None:
        capture_gradients(solo, solo_grads)
    report: dict[str, Any] = {"weights_rel_l2": [], "max_abs_weight_diff": [], "stats": []}
    for version, groups in enumerate(recorded_batches(steps, seed=sections.get("seed", 0))):
        share = split_by_cost(groups, map(group_cost, groups), world)[rank]
        stats = actor.step(share, version).stats
        weights = full_parameters(actor)
        if solo is not None:
            solo_stats = solo.step(groups, version).stats
            solo_weights = full_parameters(solo)
            report["weights_rel_l2"].append(relative_l2(weights, solo_weights))
            report["max_abs_weight_diff"].append(max(float((weights[n] - solo_weights[n]).abs().max())
                                                     for n in weights))
            report["stats"].append({"sharded": stats, "solo": solo_stats})
            if version == 0:
                report["grad_rel_l2"] = relative_l2(sharded_grads[0], solo_grads[0])
                report["grad_rel_l2_per_param"] = {n: relative_l2({n: sharded_grads[0][n]}, {n: solo_grads[0][n]})
                                                   for n in sharded_grads[0]}
    # the last share again, no-grad: the FP8 weights each block's forward uses are those of the current masters
    batch = collate(share, actor.tokenizer.pad_id)
    sharded_logp, _ = proximal_pass(actor.model, batch.input_ids, batch.targets, batch.temperature)
    full = full_parameters(actor)
    if rank == 0:
        fresh = CausalLM(actor.model.args, actor.model.precision)
        fresh.load_state_dict(full, strict=False)
        fresh.no_string = actor.model.no_string
        fresh_logp, _ = proximal_pass(fresh, batch.input_ids, batch.targets, batch.temperature)
        report["forward_matches_fresh_model"] = bool(torch.equal(sharded_logp, fresh_logp))
        report["steps_with_update"] = len(solo_grads)
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()
