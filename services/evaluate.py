"""Held-out greedy accuracy: decode each task's held-out problems at temperature 0 and count exact matches."""

from __future__ import annotations

from functions.registry import get_reward
from services.rollout.engine import Engine, Request
from shared.model import CausalLM
from shared.tasks import Problem, get_task
from shared.tokenizer import Tokenizer


def greedy_completions(
    model: CausalLM, tokenizer: Tokenizer, problems: list[Problem], max_new_tokens: int, max_batch: int = 256
) -> list[str]:
    """Greedy (temperature 0) completions of the problems' prompts, decoded without special tokens."""
    if not problems:
        return []
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    requests = [
        Request(request_id=str(i), prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0)
        for i, ids in enumerate(prompts)
    ]
    max_len = max(len(ids) for ids in prompts) + max_new_tokens + 1
    was_training = model.training
    engine = Engine(model, tokenizer.eos_id, max_batch=min(max_batch, len(requests)), max_len=max_len)
    engine.generate(requests)
    model.train(was_training)
    return [tokenizer.decode(r.output_ids) for r in requests]


def evaluate(
    model: CausalLM, tokenizer: Tokenizer, task_names: list[str], num_problems: int, max_batch: int = 256
) -> dict[str, float]:
    """Held-out greedy accuracy per task: the fraction of `task.heldout(num_problems)` whose reward says correct."""
    accuracy = {}
    for name in task_names:
        task = get_task(name)
        reward_fn = get_reward(task.reward)
        problems = task.heldout(num_problems)
        completions = greedy_completions(model, tokenizer, problems, task.max_new_tokens, max_batch)
        num_correct = sum(reward_fn(c, p.answer).correct for c, p in zip(completions, problems, strict=True))
        accuracy[name] = num_correct / max(len(problems), 1)
    return accuracy
