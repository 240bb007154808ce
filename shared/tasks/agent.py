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
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from jetroll.shared.tasks.base import Problem, import_path
from jetroll.shared.tasks.dataset import DatasetError, DatasetTask, shard_files

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


@dataclass(frozen=True)
class AgentTask:
    """A `kind: agent` entry of the job's tasks (its schema: shared/config/agent.py): a user's agent on problems from
    a JSONL file, or the stock loop (`EnvAgent`) on a multi-turn task's environment and problems."""

    name: str
    agent_path: str | None = None  # module:function
    path: str | None = None  # JSONL rows: the question, its answer, and a demonstration for the warm start
    environment: Any = None  # a registered multi-turn task, played by the stock loop (instead of agent_path and path)
    max_turns: int = 8  # the stock loop's model turns
    question_field: str = "question"
    answer_field: str = "answer"
    demonstration_field: str = "messages"  # a transcript in OpenAI's message format, assistant turns included
    demonstration_tools: str | None = None  # module:NAME of the tools the demonstrations used (the agent's)
    max_new_tokens: int = 96  # the session's budget: sampled turns and the rendered messages between them
    timeout_s: float = 30.0  # the agent's whole episode, and its session's deadline
    seed: int = 0
    reward: str = ENV_REWARD

    @cached_property
    def problems(self) -> Any:
        if self.environment is not None:
            return self.environment
        assert self.path is not None, "an agent task has a problems file or an environment (the config checks it)"
        return DatasetTask(name=self.name, path=self.path, reward=ENV_REWARD, answer_field=self.answer_field,
                           prompt_field=self.question_field, max_new_tokens=self.max_new_tokens, seed=self.seed)

    @cached_property
    def agent(self) -> Any:
        if self.environment is not None:
            return EnvAgent(self.environment.make_env, self.max_turns)
        assert self.agent_path is not None
        found = import_path(self.agent_path, "agent")
        if not inspect.iscoroutinefunction(found):
            raise ValueError(f"agent {self.agent_path!r} is not a coroutine function: an agent is "
                             "`async def run(problem, client)`")
        return found

    @cached_property
    def tools(self) -> list[dict[str, Any]] | None:
        if self.demonstration_tools is None:
            return None
        found = import_path(self.demonstration_tools, "demonstration_tools")
        if not (isinstance(found, list) and all(isinstance(t, dict) for t in found)):
            raise ValueError(f"demonstration_tools {self.demonstration_tools!r} is not a list of tool specs")
        return found

    @cached_property
    def demonstrations(self) -> dict[str, list[dict[str, Any]]]:
        """question -> the messages of every row of the problems file with a demonstration."""
        shown = {}
        for path in shard_files(self.path or ""):
            for number, line in enumerate(Path(path).read_text().splitlines(), 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                messages = row.get(self.demonstration_field)
                if messages is None:
                    continue
                if not (isinstance(messages, list) and messages and messages[-1].get("role") == "assistant"):
                    raise DatasetError(f"{path}:{number}: {self.demonstration_field!r} must be a list of messages "
                                       "that ends with an assistant turn")
                shown[str(row[self.question_field])] = messages
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
            return f"{self.max_turns}:" + (fingerprint() if fingerprint else repr(self.environment))
        return self.problems.fingerprint() + f":{self.demonstration_field}:{json.dumps(self.tools)}"

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
            raise DatasetError(f"agent task {self.name}: no training row of {self.path} has a "
                               f"{self.demonstration_field!r} demonstration to warm-start on")
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
