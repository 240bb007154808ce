"""The TRL arm of `jetroll bench agentic` (bench/trl_agentic.py): its rollout_func plays the job's episodes
as the job's turn protocol says, on a real HF model and the task's real environments."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from job_harness import REPO

from jetroll.bench.trl_grpo import job_problems
from jetroll.shared.config.job import load_config
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.tasks.registry import TASKS

pytestmark = pytest.mark.integration
trl_agentic = pytest.importorskip("jetroll.bench.trl_agentic", reason="the TRL arm needs the `peers` extra",
                                  exc_type=ImportError)


def rollout_of(model_path: str, tmp_path: Path, *overrides: str) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """Two groups of four episodes of configs/calculator_smoke.yaml's calculator through the TRL arm's rollout_func:
    (config, its output, its log)."""
    from transformers import AutoModelForCausalLM

    config = load_config(REPO / "configs" / "calculator_smoke.yaml", [f"model.path={model_path}", *overrides])
    tokenizer = load_tokenizer(model_path)
    tasks = config.build_tasks()
    drawn = job_problems(config, tasks, 2)
    rollout = trl_agentic.AgenticRollout(config, tasks, tokenizer, drawn, PromptFormat.of(config.model, tokenizer),
                                         tmp_path / "rollouts.jsonl")
    model = AutoModelForCausalLM.from_pretrained(model_path)
    trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m), model=model, num_generations=4)
    torch.manual_seed(0)  # generate() samples from torch's generator
    output = rollout([problem.prompt for _, problem in drawn for _ in range(4)], trainer)
    log = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    return config, output, log


def test_trl_rollout_plays_episodes_by_the_jobs_turn_protocol(calculator_model_path: str, tmp_path: Path) -> None:
    """Every sampled token is in the loss and every observation token out of it; an observation follows only a turn
    that ended with the turn end; an episode stays in its budget (the task's, and the context's)."""

    config, output, log = rollout_of(calculator_model_path, tmp_path)
    task = TASKS["calculator"]
    turn_end = load_tokenizer(calculator_model_path).encode(task.turn_end)[0]
    assert len(output["completion_ids"]) == 8 and output["env_status"] == ["ok"] * 8
    num_observations = 0
    for prompt_ids, ids, mask in zip(output["prompt_ids"], output["completion_ids"], output["env_mask"], strict=True):
        budget = min(config.rollout.sample_budget(task.max_new_tokens), config.rollout.max_seq_len - len(prompt_ids))
        assert len(ids) == len(mask) and 0 < len(ids) <= budget
        assert mask[0] == 1  # the model speaks first
        starts = [j for j in range(1, len(mask)) if mask[j] == 0 and mask[j - 1] == 1]
        assert all(ids[j - 1] == turn_end for j in starts)
        num_observations += len(starts)
    assert num_observations > 0
    assert log == [{"rollout_s": log[0]["rollout_s"], "failed_calls": {}, "episodes": {"ok": 8},
                    "setup_share": {"ok": log[0]["setup_share"]["ok"]}, "by_task": {"calculator": 8}}]


def test_trl_rollout_gives_an_episode_whose_environment_failed_a_completion_outside_the_loss(
    model_path: str, tmp_path: Path
) -> None:
    """With every environment call failing (no retry), each episode ends `error` at its reset: TRL still gets a
    completion, one EOS with env_mask 0 (no gradient), and the log counts the failed calls and episodes."""
    _, output, log = rollout_of(model_path, tmp_path, "tasks.0.env_faults={failure_rate: 0.999}",
                                "rollout.env_max_retries=0")
    eos = load_tokenizer(model_path).eos_id
    failed = [i for i, status in enumerate(output["env_status"]) if status != "ok"]
    assert failed and all(output["env_status"][i] == "error" for i in failed)
    for i in failed:
        assert output["completion_ids"][i] == [eos] and output["env_mask"][i] == [0]
    assert log[0]["episodes"]["failed"] == len(failed)
    assert log[0]["failed_calls"]["error"] >= len(failed)
