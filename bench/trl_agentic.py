"""The TRL arm of `jetroll bench agentic`: TRL's GRPOTrainer on the multi-environment job, in a process of its own:
`python -m jetroll.bench.trl_agentic SPEC.json`.

TRL drives a multi-turn text environment through `rollout_func`, its hook for custom rollouts, with `env_mask`
marking the environment's tokens (the route of its OpenEnv examples). Its `environment_factory` is not this job's
route: it drives environments only through tool calls in a chat template, and these take plain-text turns
(docs/bench/agentic-trl-probe/).

What TRL shares with the job (the rest as `bench peers`' TRL side, trl_grpo.py): the base; the problems, drawn as the
job's controller draws them over its weighted tasks; each task's own environment, wrapped in the same `FlakyEnv`
faults, under the same per-call timeout and retries; the turn protocol (a turn ends at the task's turn-end token or
EOS; an observation is appended unless the episode is done or out of budget); the task's reward function on the whole
transcript; the algorithm's settings.

How TRL runs it, as a TRL user writes the loop: each turn, every unfinished episode of the step generates in one
`model.generate` batch (sampling at the job's temperature), then their environments step concurrently; the step
trains once every episode has ended. An episode whose environment failed after its retries gets reward 0, since TRL
cannot drop a group.

`rollouts.jsonl` records each step's rollout: its seconds (the optimizer idles through them), its environments'
set-up share by how the episode ended, failed calls by status, episodes by task.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from jetroll.bench.trl_grpo import StepClock, grpo_settings, job_problems
from jetroll.functions.scoring import job_tasks
from jetroll.shared.config.job import JobConfig, load_config
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.tokenizer import Tokenizer, load_tokenizer
from jetroll.shared.rl.schedule import trainer_lr
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.env import Environment, EnvOutcome, EnvStep, FlakyEnv, call_env, is_multi_turn
from jetroll.shared.tasks.registry import TaskSet


@dataclass
class Episode:
    task: str
    problem: Problem
    env: Environment | None  # None: a single-turn task, one generation to EOS
    prompt_ids: list[int]
    budget: int  # output tokens (turns and observations) it may hold
    stop_ids: tuple[int, ...]  # EOS, and the turn end of a multi-turn task
    output_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1 per sampled token, 0 per observation token
    status: str = "ok"
    is_done: bool = False
    started_at: float = 0.0
    setup_s: float = 0.0


class AgenticRollout:
    """TRL's `rollout_func` for the job's tasks: prompt text -> (task, problem), episodes turn by turn."""

    def __init__(self, config: JobConfig, tasks: TaskSet, tokenizer: Tokenizer, drawn: list[tuple[str, Problem]],
                 prompt_format: PromptFormat, log_path: Path) -> None:
        self.config, self.tasks, self.tokenizer, self.prompt_format = config, tasks, tokenizer, prompt_format
        # TRL hands over prompt text only; the job's draws, in order, give each its problem (a prompt can repeat:
        # chain_sum's index into its dataset is in the answer, not the prompt)
        self.draws: dict[str, deque[tuple[str, Problem]]] = {}
        for task, problem in drawn:
            self.draws.setdefault(problem.prompt, deque()).append((task, problem))
        self.log = open(log_path, "w")  # open for the whole run
        self.num_episodes = 0

    def __call__(self, prompts: list[str], trainer: GRPOTrainer) -> dict[str, Any]:
        started = time.perf_counter()
        group_size = trainer.num_generations  # TRL's sampler repeats each prompt that many times in a row
        episodes = []
        for start in range(0, len(prompts), group_size):
            group = prompts[start : start + group_size]
            if len(group) != group_size or len(set(group)) != 1:
                raise SystemExit(f"bench agentic: TRL's batch is not groups of {group_size} copies of a prompt")
            task, problem = self.draws[group[0]].popleft()
            episodes += [self._episode(task, problem) for _ in group]
        counts = asyncio.run(self._run(episodes, trainer))
        transcripts = [self.tokenizer.decode(e.output_ids) for e in episodes]
        self.log.write(json.dumps({"rollout_s": time.perf_counter() - started, **counts}) + "\n")
        self.log.flush()
        return {"prompt_ids": [e.prompt_ids for e in episodes], "completion_ids": [e.output_ids for e in episodes],
                "logprobs": None, "env_mask": [e.env_mask for e in episodes], "transcript": transcripts,
                "task": [e.task for e in episodes], "env_status": [e.status for e in episodes]}

    def _episode(self, task_name: str, problem: Problem) -> Episode:
        task = self.tasks[task_name]
        prompt_ids = self.prompt_format.ids(problem)
        budget = min(self.config.rollout.sample_budget(task.max_new_tokens),
                     self.config.rollout.max_seq_len - len(prompt_ids))
        if not is_multi_turn(task):
            return Episode(task_name, problem, None, prompt_ids, budget, (self.tokenizer.eos_id,))
        env = task.make_env()
        faults = self.config.env_faults(task_name)
        if faults is not None:
            env = FlakyEnv(env, faults.delay_s, faults.failure_rate,
                           random.Random(f"{self.config.seed}:trl:{self.num_episodes}"))
        self.num_episodes += 1
        stop_ids = (self.tokenizer.eos_id, self.tokenizer.encode(task.turn_end)[0])
        return Episode(task_name, problem, env, prompt_ids, budget, stop_ids)

    async def _run(self, episodes: list[Episode], trainer: GRPOTrainer) -> dict[str, Any]:
        failed_calls: Counter[str] = Counter()
        setup_share: Counter[str] = Counter()
        ended: Counter[str] = Counter()

        async def call(episode: Episode, kind: str, fn: Any) -> EnvOutcome:
            t0 = time.monotonic()
            outcome = await call_env(fn, self.config.rollout.env_timeout_s, self.config.rollout.env_max_retries)
            failed_calls.update(outcome.failures)
            if kind == "reset":
                episode.setup_s = time.monotonic() - t0
            if outcome.status != "ok":
                episode.status, episode.is_done = outcome.status, True
            return outcome

        episodes_with_env = [e for e in episodes if e.env is not None]
        for e in episodes_with_env:
            e.started_at = time.monotonic()
        await asyncio.gather(*(call(e, "reset", functools.partial(e.env.reset, e.problem)) for e in episodes_with_env))
        while active := [e for e in episodes if not e.is_done]:
            turns = {}
            for stop_ids in {e.stop_ids for e in active}:  # generate stops a row at any of its stop ids
                same = [e for e in active if e.stop_ids == stop_ids]
                turns.update(zip(map(id, same), self._generate(same, trainer), strict=True))
            stepped = [e for e in active if e.env is not None and turns[id(e)] is not None]
            outcomes = await asyncio.gather(*(call(e, "step", functools.partial(e.env.step, turns[id(e)]))
                                              for e in stepped))
            for episode, outcome in zip(stepped, outcomes, strict=True):
                if outcome.status == "ok":
                    self._observe(episode, outcome.value)
        for e in episodes:
            if not e.output_ids:  # its reset failed: TRL needs a completion, so one EOS outside the loss
                e.output_ids, e.env_mask = [self.tokenizer.eos_id], [0]
        for e in episodes_with_env:
            how = "ok" if e.status == "ok" else "failed"
            ended[how] += 1
            setup_share[how] += e.setup_s / max(time.monotonic() - e.started_at, 1e-9)
        return {"failed_calls": dict(failed_calls), "episodes": dict(ended),
                "setup_share": {how: setup_share[how] / ended[how] for how in ended},
                "by_task": dict(Counter(e.task for e in episodes))}

    def _generate(self, active: list[Episode], trainer: GRPOTrainer) -> list[str | None]:
        """One turn of each active episode (all with the same stop ids), in one left-padded `generate` batch; each
        turn's text for its environment, or None where no environment steps on it (a single-turn sample, a turn cut
        off by the budget)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        rows = [e.prompt_ids + e.output_ids for e in active]
        width = max(map(len, rows))
        pad = self.tokenizer.pad_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        room = [e.budget - len(e.output_ids) for e in active]
        was_training = model.training
        model.eval()
        with torch.no_grad():
            generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                       temperature=self.config.rollout.temperature, top_p=self.config.rollout.top_p,
                                       top_k=0, max_new_tokens=max(room), pad_token_id=pad,
                                       eos_token_id=list(active[0].stop_ids))[:, width:]
        model.train(was_training)
        turns: list[str | None] = []
        for episode, ids, limit in zip(active, generated.tolist(), room, strict=True):
            stops = [i for i, t in enumerate(ids[:limit]) if t in episode.stop_ids]
            turn = ids[: stops[0] + 1] if stops else ids[:limit]
            episode.output_ids += turn
            episode.env_mask += [1] * len(turn)
            # a final turn (EOS) is stepped too, for the environment's own reward; a cut-off one is not
            episode.is_done = not stops or turn[-1] == self.tokenizer.eos_id
            if episode.env is None or not stops:
                turns.append(None)
                continue
            end = self.tokenizer.decode([episode.stop_ids[1]])
            turns.append(self.tokenizer.decode(turn).removesuffix(end))
        return turns

    def _observe(self, episode: Episode, step: Any) -> None:
        if not isinstance(step, EnvStep):
            episode.status, episode.is_done = "error", True
            return
        if episode.is_done or step.done:
            episode.is_done = True
            return
        observation = self.tokenizer.encode(step.observation)
        if len(episode.output_ids) + len(observation) >= episode.budget:
            episode.is_done = True  # no room for another turn: the episode ends as the job's would (length)
            return
        episode.output_ids += observation
        episode.env_mask += [0] * len(observation)


def run(spec: dict[str, Any]) -> None:
    torch.set_num_threads(spec["threads"])
    config = load_config(Path(spec["config"]), spec["overrides"])
    base, out = Path(spec["base_dir"]), Path(spec["out_dir"])
    steps, snapshot_every = spec["steps"], spec["snapshot_every"]
    names = json.loads((base / "tokenizer_config.json").read_text())
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(base / "tokenizer.json"), eos_token=names["eos_token"],
                                           pad_token=names["pad_token"])
    tokenizer = load_tokenizer(base)
    prompt_format = PromptFormat.of(config.model, tokenizer)
    if prompt_format.template is not None:
        raise SystemExit("bench agentic: the TRL arm runs plain-text prompts (model.chat_template: false)")
    tasks = job_tasks(config)
    drawn = job_problems(config, tasks, steps * config.trainer.groups_per_step)
    rollout = AgenticRollout(config, tasks, tokenizer, drawn, prompt_format, out / "rollouts.jsonl")
    rewards = {name: tasks.reward_fn(tasks[name]) for name in {task for task, _ in drawn}}

    def reward(prompts: list[Any], completions: list[Any], transcript: list[str], task: list[str],
               env_status: list[str], answer: list[str], **_: Any) -> list[float]:
        return [rewards[t](text, a).reward if status == "ok" else 0.0
                for text, t, status, a in zip(transcript, task, env_status, answer, strict=True)]

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.trainer.lr, weight_decay=config.trainer.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: trainer_lr(config.trainer, step) / config.trainer.lr)
    budget = max(min(config.rollout.sample_budget(tasks[t.name].max_new_tokens), config.rollout.max_seq_len)
                 for t in config.tasks)
    settings = grpo_settings(config, steps, spec["seed"], out / "trl", budget)
    clock = StepClock(out, base, snapshot_every, config.trainer.updates_per_batch)
    rows = [{"prompt": problem.prompt, "answer": problem.answer} for _, problem in drawn]
    trainer = GRPOTrainer(model=model, reward_funcs=reward, processing_class=hf_tokenizer,
                          args=GRPOConfig(**settings), train_dataset=Dataset.from_list(rows),
                          optimizers=(optimizer, schedule), callbacks=[clock], rollout_func=rollout)
    clock.snapshot(trainer.model, 0)
    clock.start()
    trainer.train()


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
