"""Agents as a task (`kind: agent` in a job's tasks): a user's program that talks to the policy through an
OpenAI-compatible endpoint (shared/agents/gateway.py), and knows nothing of jetroll.

An agent is `async def run(problem: Problem, client: openai.AsyncOpenAI) -> AgentResult | float`, named by its
import path (`module:function`, which may import anything); shared/agents/client.py runs it.
Its reward (in [0, 1]) is the trained reward: the task's reward is `env`, which the reward router reads from the
trajectory.

Problems come from a JSONL file (a dataset task's splits: by hash on the question), and the warm start from the
rows' demonstrations (a transcript in OpenAI's message format) with the agent's tools, rendered by the bridge rule of
shared/model/transcript.py, so the base model learns turns in the layout the gateway will give it.
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from jetroll.shared.tasks.base import Problem, Task, import_path
from jetroll.shared.tasks.dataset import DatasetError, DatasetTask, DatasetTaskConfig, shard_files
from jetroll.shared.tasks.entry import EntryTask, TaskMixEntry

EXTRA = "agents need the `agents` extra: pip install 'jetroll[agents]'"
ENV_REWARD = "env"  # a task whose reward is this is scored by its environment's (its agent's) own reward


@dataclass(frozen=True, slots=True)
class AgentResult:
    """What an agent returns: its reward in [0, 1], and whether it solved the problem (None: reward == 1)."""

    reward: float
    correct: bool | None = None

    @property
    def is_correct(self) -> bool:
        return self.reward == 1.0 if self.correct is None else self.correct


class AgentTaskConfig(TaskMixEntry):
    """An agent program trained through the gateway (`kind: agent`; needs the `agents` extra and a model with a
    chat template). Its reward is the agent's own. Its task: `AgentTask`."""

    kind: Literal["agent"] = Field(description="marks an agent task")
    name: str = Field(min_length=1, description="the task's name in events, metrics and the pools' task lists")
    agent: str | None = Field(None, pattern=r"^[\w.]+:\w+$", description="the agent, `module:function`: `async "
                              "def run(problem, client: openai.AsyncOpenAI) -> AgentResult | float` (its reward in "
                              "[0, 1]); or set environment instead")
    environment: str | None = Field(None, min_length=1, description="instead of an agent: a multi-turn task of the "
                                    "job or the registry (calculator, a gymnasium entry listed before this one), "
                                    "played by the stock loop on the gateway, with its problems and solver turns")
    max_turns: int = Field(8, ge=1, description="the stock loop's model turns (with environment)")
    path: str | None = Field(None, min_length=1, description="with agent: JSONL problems, a question, its answer "
                             "and, for the warm start, a demonstration (a transcript in OpenAI's message format)")
    question_field: str = Field("question", min_length=1, description="the row's question (Problem.prompt)")
    answer_field: str = Field("answer", min_length=1, description="the row's answer (Problem.answer)")
    demonstration_field: str = Field("messages", min_length=1, description="the row's demonstration transcript")
    demonstration_tools: str | None = Field(None, pattern=r"^[\w.]+:\w+$", description="the tools the "
                                            "demonstrations used, `module:NAME` (a list of OpenAI function specs, "
                                            "the agent's own); None: none")
    max_new_tokens: int = Field(96, ge=1, description="a session's token budget after its first prompt: sampled "
                                "turns and the messages rendered between them (capped by rollout.max_new_tokens)")
    timeout_s: float = Field(30.0, gt=0, description="an episode's deadline: the agent's whole run, and its "
                             "session's (past it: env status timeout, its group dropped and counted)")

    @model_validator(mode="after")
    def _runnable(self) -> AgentTaskConfig:
        try:
            import aiohttp  # noqa: F401
            import openai  # noqa: F401
        except ImportError:
            raise ValueError(EXTRA) from None
        if (self.agent is None) == (self.environment is None):
            raise ValueError(f"agent task {self.name}: set exactly one of agent and environment")
        if (self.agent is None) != (self.path is None):
            raise ValueError(f"agent task {self.name}: path (the problems file) goes with agent; an environment "
                             "brings its own problems")
        if self.agent is not None:
            task = self.build(0, {})
            _ = task.agent, task.tools  # each imports now, or says why it cannot
        return self

    def build(self, seed: int, known: Mapping[str, Task]) -> AgentTask:
        """The task this entry describes, in a job of `seed`; `known` holds the tasks an environment may name (the
        job validated that it names a multi-turn one)."""
        return AgentTask(self, None if self.environment is None else known[self.environment], seed)


@dataclass(frozen=True)
class AgentTask(EntryTask):
    """A `kind: agent` entry of the job's tasks: a user's agent on problems from a JSONL file, or the stock loop
    (`EnvAgent`) on a multi-turn task's environment and problems."""

    entry: AgentTaskConfig
    environment: Any = None  # the multi-turn task the entry names, played by the stock loop (None: the agent's own)
    seed: int = 0
    reward: str = ENV_REWARD

    @property
    def timeout_s(self) -> float:
        return self.entry.timeout_s

    @cached_property
    def problems(self) -> Any:
        if self.environment is not None:
            return self.environment
        entry = self.entry
        assert entry.path is not None, "an agent task has a problems file or an environment (the config checks it)"
        return DatasetTask(DatasetTaskConfig(kind="dataset", name=entry.name, path=entry.path, reward=ENV_REWARD,
                                             answer_field=entry.answer_field, prompt_field=entry.question_field,
                                             max_new_tokens=entry.max_new_tokens), self.seed)

    @cached_property
    def agent(self) -> Any:
        if self.environment is not None:
            return EnvAgent(self.environment.make_env, self.entry.max_turns)
        assert self.entry.agent is not None
        found = import_path(self.entry.agent, "agent")
        if not inspect.iscoroutinefunction(found):
            raise ValueError(f"agent {self.entry.agent!r} is not a coroutine function: an agent is "
                             "`async def run(problem, client)`")
        return found

    @cached_property
    def tools(self) -> list[dict[str, Any]] | None:
        if self.entry.demonstration_tools is None:
            return None
        found = import_path(self.entry.demonstration_tools, "demonstration_tools")
        if not (isinstance(found, list) and all(isinstance(t, dict) for t in found)):
            raise ValueError(f"demonstration_tools {self.entry.demonstration_tools!r} is not a list of tool specs")
        return found

    @cached_property
    def demonstrations(self) -> dict[str, list[dict[str, Any]]]:
        """question -> the messages of every row of the problems file with a demonstration."""
        shown = {}
        for path in shard_files(self.entry.path or ""):
            for number, line in enumerate(Path(path).read_text().splitlines(), 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                messages = row.get(self.entry.demonstration_field)
                if messages is None:
                    continue
                if not (isinstance(messages, list) and messages and messages[-1].get("role") == "assistant"):
                    raise DatasetError(f"{path}:{number}: {self.entry.demonstration_field!r} must be a list of "
                                       "messages that ends with an assistant turn")
                shown[str(row[self.entry.question_field])] = messages
        return shown

    def demonstration(self, problem: Problem) -> list[dict[str, Any]]:
        """A training problem's demonstration: its row's, or the environment's solver turns as the stock loop would
        send them (each observation a user message)."""
        if self.environment is None:
            return self.demonstrations[problem.prompt]
        messages = [{"role": "user", "content": problem.prompt}]
        for turn, observation in self.environment.sft_turns(problem):
            messages.append({"role": "assistant", "content": turn})
            if observation:
                messages.append({"role": "user", "content": observation})
        return messages

    def fingerprint(self) -> str:
        if self.environment is not None:
            fingerprint = getattr(self.environment, "fingerprint", None)
            return f"{self.entry.max_turns}:" + (fingerprint() if fingerprint else repr(self.environment))
        return self.problems.fingerprint() + f":{self.entry.demonstration_field}:{json.dumps(self.tools)}"

    def sample(self, rng: random.Random, index: int) -> Problem:
        return self.problems.sample(rng, index)

    def heldout(self, n: int) -> list[Problem]:
        return self.problems.heldout(n)

    def probe(self, n: int) -> list[Problem]:
        return self.problems.probe(n)

    def sft_sample(self, rng: random.Random) -> Problem:
        if self.environment is not None:
            return self.environment.sft_sample(rng)
        return rng.choice(self.demonstrated)

    @cached_property
    def demonstrated(self) -> list[Problem]:
        """The training problems that have a demonstration (the warm start draws from them, every example)."""
        train = [p for p in self.problems.rows.train if p.prompt in self.demonstrations]
        if not train:
            raise DatasetError(f"agent task {self.name}: no training row of {self.entry.path} has a "
                               f"{self.entry.demonstration_field!r} demonstration to warm-start on")
        return train

    def sft_completion(self, problem: Problem) -> str:
        raise NotImplementedError("an agent's warm start is token ids: shared/warm_start.py's demonstration_ids")


class EnvAgent:
    """The stock agent loop: a reset/step text environment (shared/tasks/env.py) played through the chat endpoint,
    so that an environment without an agent of its own can run on the gateway path. The problem's prompt is the
    first user message; each model turn is the assistant's content, stepped through the environment; each
    observation is the next user message. The reward is the environment's last one (0 if it gave none); a turn
    cut by the session's budget ends the episode there."""

    def __init__(self, make_env: Any, max_turns: int) -> None:
        self.make_env = make_env
        self.max_turns = max_turns

    async def __call__(self, problem: Problem, client: Any) -> AgentResult:
        env = self.make_env()
        await env.reset(problem)
        messages: list[dict[str, Any]] = [{"role": "user", "content": problem.prompt}]
        reward = 0.0
        for _ in range(self.max_turns):
            response = await client.chat.completions.create(model="policy", messages=messages)
            choice = response.choices[0]
            if choice.finish_reason == "length":
                break
            turn = choice.message.content or ""
            messages.append({"role": "assistant", "content": turn})
            step = await env.step(turn)
            reward = step.reward if step.reward is not None else reward
            if step.done:
                break
            messages.append({"role": "user", "content": step.observation})
        return AgentResult(reward)
