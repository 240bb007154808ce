"""The supervised warm start's batches: a task's problems as input ids and targets, prompts and an environment's
observations left out of the loss, and an agent's demonstration tokenized as the gateway would have given it."""

from __future__ import annotations

import random
from typing import Any

import torch

from jetroll.shared.model.chat import PromptFormat, render_chat
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.model.transcript import SENTINEL, Transcript
from jetroll.shared.tasks.agent import AgentTask
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.env import is_multi_turn
from jetroll.shared.tasks.registry import TaskSet

IGNORE_INDEX = -100


def demonstration_ids(task: AgentTask, problem: Problem, tokenizer: Tokenizer
                      ) -> tuple[list[int], list[int], list[bool]]:
    """An agent task's demonstration as the gateway would have built it (prompt ids, completion ids, which completion
    ids are trained): each assistant turn tokenized as the template renders it, up to and with its end token, and
    the messages between turns rendered by the bridge rule (shared/model/transcript.py)."""
    messages, tools = task.demonstration(problem), task.tools
    template = tokenizer.chat_template
    assert template is not None, "an agent task's model has a chat template (the config checks it)"
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    transcript = Transcript.start(template, tokenizer, messages[:first], tools)
    index = first
    while index < len(messages):
        transcript.add_sampled(_turn_ids(tokenizer, template, messages[index], tools))
        following = index + 1
        while following < len(messages) and messages[following]["role"] != "assistant":
            following += 1
        if following > index + 1:
            transcript.extend(transcript.messages[:index + 1] + messages[index + 1:following])
        index = following
    trained = [bool(m) for m in transcript.loss_mask[transcript.num_prompt:]]
    return transcript.ids[:transcript.num_prompt], transcript.ids[transcript.num_prompt:], trained


def _turn_ids(tokenizer: Tokenizer, template: str, message: dict[str, Any],
              tools: list[dict[str, Any]] | None) -> list[int]:
    """An assistant message as the policy samples it: the template's rendering of the turn, its end token included,
    the template's text after that token excluded."""
    special = tokenizer.special_tokens()
    probe = [{"role": "user", "content": SENTINEL}]
    before = render_chat(template, probe, special, tools=tools)
    after = render_chat(template, [*probe, message], special, tools=tools, add_generation_prompt=False)
    turn = after[len(before):]
    return tokenizer.encode(turn[:turn.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)])


def sft_batch(
    tokenizer: Tokenizer, tasks: TaskSet, task_names: list[str], batch_size: int, rng: random.Random,
    prompts: PromptFormat | None = None, task_weights: dict[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [B, S] and targets [B, S]: targets are the completion + EOS; prompts (formatted as the job formats
    them), a multi-turn task's observations (the environment writes them) and padding are ignored. Each row's task
    is drawn uniformly, or by `task_weights` (1 for a task it leaves out)."""
    prompt_format = prompts or PromptFormat(tokenizer)
    weights = [task_weights.get(name, 1.0) for name in task_names] if task_weights else None
    rows = []
    for _ in range(batch_size):
        # uniform draws keep rng.choice, so the bases built before task_weights existed stay what they were
        name = rng.choices(task_names, weights)[0] if weights else rng.choice(task_names)
        task = tasks[name]
        problem = task.sft_sample(rng)
        if isinstance(task, AgentTask):  # a demonstration, tokenized as the gateway would have
            prompt, target, trained = demonstration_ids(task, problem, tokenizer)
            rows.append((prompt, target, [i if t else IGNORE_INDEX for i, t in zip(target, trained, strict=True)]))
            continue
        prompt = prompt_format.ids(problem)
        target = tokenizer.encode(task.sft_completion(problem)) + [tokenizer.eos_id]
        labels = list(target)
        if is_multi_turn(task):
            labels = []
            for turn, observation in task.sft_turns(problem):
                labels += tokenizer.encode(turn + (task.turn_end if observation else ""))
                labels += [IGNORE_INDEX] * len(tokenizer.encode(observation))
            labels.append(tokenizer.eos_id)
            assert len(labels) == len(target), "sft_turns must spell out sft_completion"
        rows.append((prompt, target, labels))
    seq = max(len(p) + len(t) for p, t, _ in rows) - 1
    inputs = torch.full((batch_size, seq), tokenizer.pad_id, dtype=torch.long)
    targets = torch.full((batch_size, seq), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, target, labels) in enumerate(rows):
        ids = prompt + target
        inputs[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        targets[i, len(prompt) - 1 : len(ids) - 1] = torch.tensor(labels)
    return inputs, targets
