"""Held-out greedy accuracy: decode each task's held-out problems at temperature 0 and count exact matches.

A multi-turn task's episodes run their environment turns too, so its held-out success rate is the real one."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from jetroll.shared.agents.client import InlineAgents
from jetroll.shared.config.job import JobConfig, validate_config
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.engine.turns import TurnRunner, run_episodes
from jetroll.shared.errors import ConfigError
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.checkpoint import load_pretrained
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import Tokenizer
from jetroll.shared.store import setup_store
from jetroll.shared.tasks.agent import AgentTask
from jetroll.shared.tasks.base import Problem, Task
from jetroll.shared.tasks.env import is_multi_turn
from jetroll.shared.tasks.registry import Rewards, TaskSet

ENV_TIMEOUT_S = 10.0
AGENT_PROMPT_ROOM = 384  # tokens for an agent's first request (its tools and question): it is rendered in the session


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


async def _agent_episodes(engine: Engine, tokenizer: Tokenizer, task: AgentTask, requests: list[Request],
                          problems: list[Problem]) -> list[float | None]:
    """An agent task's episodes through a gateway on this loop, its agents beside it: each episode's reward."""
    from jetroll.shared.agents.gateway import Gateway

    gateway = Gateway(tokenizer, engine.max_len, temperature=0.0, top_p=1.0)
    await gateway.start()
    agents = InlineAgents(task.agent, task.timeout_s)
    runner = TurnRunner(engine, tokenizer, task.timeout_s, max_retries=0)
    try:
        for request, problem in zip(requests, problems, strict=True):
            session = gateway.open(request.request_id, request.max_new_tokens, task.timeout_s)
            runner.start(request, session, problem)
            agents.launch(session.url, problem)
        await run_episodes(engine, runner)
        await agents.drain()
    finally:
        await gateway.close()
    return [runner.env_result(r.request_id).reward for r in requests]


def agent_accuracy(model: CausalLM, tokenizer: Tokenizer, task: AgentTask, problems: list[Problem],
                   max_batch: int = 256) -> float:
    """The fraction of `problems` an agent solves on the greedy policy: its reward is 1 (a failed episode, or one
    out of budget, is not solved)."""
    if not problems:
        return 0.0
    requests = [Request(str(i), [tokenizer.eos_id], task.max_new_tokens, temperature=0.0,
                        turn_end_id=tokenizer.eos_id) for i in range(len(problems))]
    engine = Engine(model, tokenizer.eos_id, max_batch=min(max_batch, len(requests)),
                    max_len=AGENT_PROMPT_ROOM + task.max_new_tokens)
    was_training = model.training
    rewards = asyncio.run(_agent_episodes(engine, tokenizer, task, requests, problems))
    model.train(was_training)
    return sum(reward == 1.0 for reward in rewards) / len(problems)


def accuracy_on(
    model: CausalLM, tokenizer: Tokenizer, tasks: TaskSet, task: Task, problems: list[Problem], max_batch: int = 256,
    prompts: PromptFormat | None = None,
) -> float:
    """The fraction of `problems` of `task` whose greedy completion its reward (from `tasks`) calls correct (an
    agent's: that it solves)."""
    if isinstance(task, AgentTask):
        return agent_accuracy(model, tokenizer, task, problems, max_batch)
    reward_fn = tasks.reward_fn(task)
    completions = greedy_completions(model, tokenizer, problems, task.max_new_tokens, max_batch, task, prompts)
    num_correct = sum(reward_fn(c, p.answer).correct for c, p in zip(completions, problems, strict=True))
    return num_correct / max(len(problems), 1)


def evaluate(
    model: CausalLM, tokenizer: Tokenizer, tasks: TaskSet, task_names: list[str], num_problems: int,
    max_batch: int = 256, prompts: PromptFormat | None = None,
) -> dict[str, float]:
    """Held-out greedy accuracy per task: the fraction of `task.heldout(num_problems)` whose reward says correct."""
    return {name: accuracy_on(model, tokenizer, tasks, tasks[name], tasks[name].heldout(num_problems), max_batch,
                              prompts) for name in task_names}


def score_model_dir(directory: Path, config: JobConfig, tasks: TaskSet,
                    problems: dict[str, list[Problem]]) -> dict[str, float]:
    """The held-out accuracy per task of the HF-format model in `directory`, loaded and prompted as `config`'s job
    loads and prompts its weights."""
    model, tokenizer = load_pretrained(directory, config.precision.numerics())
    prompts = PromptFormat.of(config.model, tokenizer)
    return {name: accuracy_on(model, tokenizer, tasks, tasks[name], task_problems, prompts=prompts)
            for name, task_problems in problems.items()}


def scoring_problems(task: Task, split: Literal["heldout", "train"], n: int) -> list[Problem]:
    """`n` problems of a task's held-out split, or a fixed draw of its training split (the problems a job trains
    on come from it): far higher accuracy on training problems than on held-out ones means the model has learnt
    its problems rather than the skill, which small procedural spaces invite."""
    if split == "heldout":
        return task.heldout(n)
    rng = random.Random(f"{task.name}-train-eval")
    return [task.sample(rng, index) for index in range(1, n + 1)]


async def score_run(run_dir: Path, rewards: Rewards, versions: Sequence[int] | None = None,
                    num_problems: int | None = None,
                    split: Literal["heldout", "train"] = "heldout") -> list[dict[str, Any]]:
    """`jetroll eval`: score a job's published weight versions again, as its controller scored them (its config's
    tasks, prompt format and precision; the store its config names), on `num_problems` problems per task (default:
    the job's eval.num_problems) of the `split` (`scoring_problems`), each by its reward in `rewards`. Default
    versions: those the job scored (eval.jsonl) that its store still holds, else the newest. One row per version:
    its accuracy per task and how many problems each task had."""
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{run_dir} holds no config.json: not a jetroll run dir (`jetroll run --run-dir`)")
    config = validate_config(json.loads(config_path.read_text()))
    num_problems = config.eval.num_problems if num_problems is None else num_problems
    if num_problems < 1:
        raise ConfigError(f"--num-problems must be at least 1, not {num_problems}")
    store = setup_store(config.store, config.job_id, run_dir)
    held = await store.versions()
    if not held:
        raise ConfigError(f"{run_dir}: the job's store holds no published weights")
    if versions is None:
        scored = run_dir / "eval.jsonl"
        lines = scored.read_text().splitlines() if scored.is_file() else []
        evaluated = [json.loads(line)["version"] for line in lines]
        versions = [v for v in evaluated if v in held] or held[-1:]
    missing = sorted(set(versions) - set(held))
    if missing:
        raise ConfigError(f"{run_dir}: the job's store no longer holds version(s) {missing}; it holds {held}")
    tasks = config.build_tasks(rewards)
    problems = {t.name: scoring_problems(tasks[t.name], split, num_problems) for t in config.tasks}
    rows = []
    for version in versions:
        started = time.perf_counter()
        # a multi-turn task plays its episodes on an event loop of its own
        accuracy = await asyncio.to_thread(score_model_dir, await store.fetch(version), config, tasks,
                                          problems)
        rows.append({"version": version, **accuracy, "num_problems": {n: len(p) for n, p in problems.items()}})
        print(f"jetroll eval: v{version}: {accuracy} ({time.perf_counter() - started:.1f} s)", file=sys.stderr,
              flush=True)
    return rows
