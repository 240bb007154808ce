"""A real Trainer on a tiny model, and scored groups whose behaviour log-probs set pi_prox / mu to chosen ratios.
The model's fixture (`model_dir`) is in conftest.py."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch
from factories import NO_MISMATCH_GATES, scored
from factories import trajectory as make_trajectory

from jetroll.functions.scoring import job_tasks
from jetroll.services.trainer.trainer import Trainer
from jetroll.shared.config.job import validate_config
from jetroll.shared.config.model import ModelConfig
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import ScoredEvent
from jetroll.shared.rl.batch import GroupBuffer, PendingGroup, collate
from jetroll.shared.rl.passes import proximal_pass
from jetroll.shared.store import setup_store

TINY = ModelConfig(num_layers=1, intermediate_size=256)
CORRECTIONS = ("decoupled", "none", "token_tis", "seq_mis", "icepop")
# r = pi_prox / mu of each completion token, two groups of four; sequence products 0.36, 60, 1.08, 16 | 1.35, 4.8,
# 0.9, 7.2, so seq_mis (C = 2) keeps the first, third, fifth and seventh sequences
RATIOS = ((0.3, 0.8, 1.5), (3.0, 20.0), (0.8, 1.5, 0.3, 3.0), (20.0, 0.8),
          (1.5, 3.0, 0.3), (0.3, 20.0, 0.8), (3.0, 0.3), (0.8, 20.0, 1.5, 0.3))
REWARDS = ((1.0, 0.0, 1.0, 0.0), (0.0, 1.0, 1.0, 0.0))
PROMPTS = ("12+34=", "7-5=")


def make_trainer(model_dir: Path, run_dir: Path, redis_url: str, job_id: str | None = None,
                 **sections: Any) -> Trainer:
    """A real Trainer on the tiny model; the step under test never touches its bus or store."""
    tree: dict[str, Any] = {"job_id": job_id or f"t{uuid.uuid4().hex[:8]}", "trainer": {"group_size": 4},
                            "model": {**TINY.model_dump(), "path": str(model_dir)},
                            "store": {"root": str(run_dir / "store")}, "precision": {"mismatch": NO_MISMATCH_GATES}}
    for name, fields in sections.items():
        tree[name] = {**tree.get(name, {}), **fields} if isinstance(fields, dict) else fields
    config = validate_config(tree)
    bus = RedisBus(redis_url, config.job_id, claim_idle_ms=config.redis.claim_idle_ms)
    return Trainer(config, job_tasks(config), bus, setup_store(config.store, config.job_id, run_dir), "trainer")


def trajectory(job_id: str, row: int, completion: list[int], behavior_logp: list[float],
               rewards: tuple[tuple[float, ...], ...] = REWARDS, v_tok: list[int] | int = 0) -> ScoredEvent:
    group, sample = divmod(row, 4)
    tokenizer = build_char_tokenizer()
    traj = make_trajectory(f"g{group}:{sample}", completion, job_id=job_id, prompt=PROMPTS[group], answer="0",
                           prompt_ids=tokenizer.encode(PROMPTS[group]), behavior_logprobs=behavior_logp, group_size=4,
                           v_tok=v_tok)
    return scored(traj, rewards[group][sample])


def groups_of(events: list[ScoredEvent]) -> list[PendingGroup]:
    """The step's groups, through the trainer's own buffer."""
    buffer = GroupBuffer()
    for i, event in enumerate(events):
        assert buffer.add(f"0-{i}", event)
    groups = buffer.take_oldest(len(REWARDS))
    assert groups is not None
    return groups


def events_with_ratios(trainer: Trainer, ratios_of_rows: tuple[tuple[float, ...], ...] = RATIOS,
                       rewards: tuple[tuple[float, ...], ...] = REWARDS,
                       v_toks: tuple[list[int] | int, ...] | None = None) -> list[ScoredEvent]:
    """Events whose mu = the trainer's own log-prob of each token minus log(ratio): pi_prox / mu = the ratios; each
    row's tokens carry the versions `v_toks` gives it (0 by default)."""
    job = trainer.config.job_id
    completions = [[trainer.actor.tokenizer.encode(str(d))[0] for d in range(len(r))] for r in ratios_of_rows]
    placeholder = [trajectory(job, i, c, [0.0] * len(c)) for i, c in enumerate(completions)]
    batch = collate(groups_of(placeholder), trainer.actor.tokenizer.pad_id)
    logp, _ = proximal_pass(trainer.actor.model, batch.input_ids, batch.targets, batch.temperature)
    events = []
    for row, (completion, ratios) in enumerate(zip(completions, ratios_of_rows, strict=True)):
        own = logp[row][batch.loss_mask[row] > 0]
        v_tok = 0 if v_toks is None else v_toks[row]
        events.append(trajectory(job, row, completion, (own - torch.tensor(ratios).log()).tolist(), rewards, v_tok))
    return events


def step(trainer: Trainer, groups: list[PendingGroup]) -> dict[str, float]:
    """One real trainer step, its precision mismatch measured as its commit measures it."""
    stats, measure = trainer._step(groups)
    return stats | measure()


def flat_parameters(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.actor.model.parameters()])
