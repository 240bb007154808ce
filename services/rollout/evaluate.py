"""Held-out greedy accuracy: decode each task's held-out problems at temperature 0 and count exact matches.

A multi-turn task's episodes run their environment turns too, so its held-out success rate is the real one."""

from __future__ import annotations

import asyncio

from jetroll.functions.runner import get_reward
from jetroll.services.rollout.engine import Engine, Request
from jetroll.services.rollout.turns import TurnRunner, run_episodes
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.tasks.base import Problem, Task
from jetroll.shared.tasks.env import is_multi_turn
from jetroll.shared.tasks.registry import get_task

ENV_TIMEOUT_S = 10.0


def greedy_completions(
    model: CausalLM, tokenizer: Tokenizer, problems: list[Problem], max_new_tokens: int, max_batch: int = 256,
    task: Task | None = None, prompts: PromptFormat | None = None,
) -> list[str]:
    """Greedy (temperature 0) completions of the problems' prompts (formatted as the job formats them), decoded
    without special tokens; for a multi-turn `task`, whole transcripts (model turns and the environment's
    observations)."""
    if not problems:
        return []
    prompt_format = prompts or PromptFormat(tokenizer)
    prompts_ids = [prompt_format.ids(p) for p in problems]
    multi_turn = task is not None and is_multi_turn(task)
    turn_end_id = tokenizer.encode(task.turn_end)[0] if multi_turn else None
    requests = [
        Request(request_id=str(i), prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0,
                turn_end_id=turn_end_id)
        for i, ids in enumerate(prompts_ids)
    ]
    max_len = max(len(ids) for ids in prompts_ids) + max_new_tokens + 1
    was_training = model.training
    engine = Engine(model, tokenizer.eos_id, max_batch=min(max_batch, len(requests)), max_len=max_len)
    if multi_turn:
        asyncio.run(_episodes(engine, tokenizer, task, requests, problems))
    else:
        engine.generate(requests)
    model.train(was_training)
    return [tokenizer.decode(r.output_ids) for r in requests]


async def _episodes(engine: Engine, tokenizer: Tokenizer, task: Task, requests: list[Request],
                    problems: list[Problem]) -> None:
    runner = TurnRunner(engine, tokenizer, ENV_TIMEOUT_S)
    for request, problem in zip(requests, problems, strict=True):
        runner.start(request, task.make_env(), problem)
    await run_episodes(engine, runner)


def accuracy_on(
    model: CausalLM, tokenizer: Tokenizer, task: Task, problems: list[Problem], max_batch: int = 256,
    prompts: PromptFormat | None = None,
) -> float:
    """The fraction of `problems` of `task` whose greedy completion its reward calls correct."""
    reward_fn = get_reward(task.reward)
    completions = greedy_completions(model, tokenizer, problems, task.max_new_tokens, max_batch, task, prompts)
    num_correct = sum(reward_fn(c, p.answer).correct for c, p in zip(completions, problems, strict=True))
    return num_correct / max(len(problems), 1)


def evaluate(
    model: CausalLM, tokenizer: Tokenizer, task_names: list[str], num_problems: int, max_batch: int = 256,
    prompts: PromptFormat | None = None,
) -> dict[str, float]:
    """Held-out greedy accuracy per task: the fraction of `task.heldout(num_problems)` whose reward says correct."""
    return {name: accuracy_on(model, tokenizer, get_task(name), get_task(name).heldout(num_problems), max_batch,
                              prompts) for name in task_names}
