"""tasks: a `kind: agent` entry, a user's OpenAI-client agent as a task (shared/agents/task.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from jetroll.shared.config.base import TaskMixEntry
from jetroll.shared.tasks.agent import EXTRA, AgentTask
from jetroll.shared.tasks.base import Task


class AgentTaskConfig(TaskMixEntry):
    """An agent program trained through the gateway (`kind: agent`; needs the `agents` extra and a model with a
    chat template). Its reward is the agent's own."""

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
        return AgentTask(name=self.name, agent_path=self.agent, path=self.path,
                         environment=None if self.environment is None else known[self.environment],
                         max_turns=self.max_turns, question_field=self.question_field,
                         answer_field=self.answer_field, demonstration_field=self.demonstration_field,
                         demonstration_tools=self.demonstration_tools, max_new_tokens=self.max_new_tokens,
                         timeout_s=self.timeout_s, seed=seed)
