"""`kind: agent` tasks: the config validates the agent, its tools and its model; the warm start's demonstrations are
tokenized as the gateway would have built them; every pool gets its environment workers, and a job without agents
none."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from jetroll.services.launch.local import Launcher
from jetroll.shared.config.job import validate_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.model.chat import render_chat
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.sft import IGNORE_INDEX, demonstration_ids, sft_batch
from jetroll.shared.tasks.agent import EnvAgent
from jetroll.shared.tasks.registry import TASKS

REPO = Path(__file__).resolve().parents[3]
BPE_AGENT = str(REPO / "configs" / "models" / "bpe-agent")
TOKENIZER = load_tokenizer(BPE_AGENT)


def agent_job(**task: object) -> dict:
    return {"model": {"tokenizer": BPE_AGENT, "chat_template": True},
            "tasks": [{"kind": "agent", "name": "calc_agent", "agent": "examples.calculator_agent:run",
                       "path": str(REPO / "data" / "agent_calc.jsonl"),
                       "demonstration_tools": "examples.calculator_agent:TOOLS", **task}]}


def test_the_config_refuses_an_agent_it_cannot_run() -> None:
    for bad, needle in [({"agent": "examples.calculator_agent:nothing"}, "has no nothing"),
                        ({"agent": "examples.calculator_agent:calculate"}, "not a coroutine function"),
                        ({"agent": "no_such_module:run"}, "cannot import no_such_module"),
                        ({"demonstration_tools": "examples.calculator_agent:CALCULATOR"}, "not a list of tool specs"),
                        ({"timeout_s": 0}, "timeout_s")]:
        with pytest.raises(ConfigError, match=needle):
            validate_config(agent_job(**bad))
    plain = agent_job()
    plain["model"] = {"tokenizer": BPE_AGENT}
    with pytest.raises(ConfigError, match="chat_template: true"):
        validate_config(plain)


def test_a_demonstration_is_the_gateways_tokens_with_only_the_assistants_trained() -> None:
    tasks = validate_config(agent_job()).build_tasks()
    task = tasks["calc_agent"]
    problem = task.sft_sample(random.Random(0))
    prompt, completion, trained = demonstration_ids(task, problem, TOKENIZER)
    tools = task.tools
    messages = task.demonstration(problem)
    assert prompt == TOKENIZER.encode(render_chat(TOKENIZER.chat_template, messages[:1], TOKENIZER.special_tokens(),
                                                  tools=tools))
    # the whole transcript is the template's rendering of the demonstration, tokenized a turn at a time
    whole = render_chat(TOKENIZER.chat_template, messages, TOKENIZER.special_tokens(), tools=tools,
                        add_generation_prompt=False)
    assert TOKENIZER.backend.decode(prompt + completion, skip_special_tokens=False) == whole.removesuffix("\n")
    sampled = [t for t, k in zip(completion, trained, strict=True) if k]
    assert TOKENIZER.backend.decode(sampled, skip_special_tokens=False) == (
        f'<tool_call>{{"name": "calculator", "arguments": {messages[1]["tool_calls"][0]["function"]["arguments"]}}}'
        f'</tool_call><|im_end|>{messages[3]["content"]}<|im_end|>')
    inputs, targets = sft_batch(TOKENIZER, tasks, ["calc_agent"], 4, random.Random(0))
    assert ((targets != IGNORE_INDEX).sum(1) > 20).all() and (targets == TOKENIZER.eos_id).sum() == 8  # 2 turns each


def test_every_pool_runs_its_environment_workers_when_the_job_has_agents(tmp_path: Path) -> None:
    config = validate_config({**agent_job(), "rollout": {"pools": [{"name": "a", "env_workers": 2}, {"name": "b"}]}})
    services = Launcher(config, tmp_path, "redis://127.0.0.1:1/0").services
    assert sorted(s.name for s in services if s.kind == "env") == ["env-a-0", "env-a-1", "env-b-0"]
    assert {s.pool for s in services if s.kind == "env"} == {"a", "b"}
    plain = validate_config({"rollout": {"pools": [{"name": "a", "env_workers": 2}]}})
    assert not [s for s in Launcher(plain, tmp_path, "redis://127.0.0.1:1/0").services if s.kind == "env"]


def test_an_environment_without_an_agent_is_an_agent_task_played_by_the_stock_loop() -> None:
    config = validate_config({"model": {"tokenizer": BPE_AGENT, "chat_template": True},
                              "tasks": [{"kind": "agent", "name": "calc_chat", "environment": "calculator",
                                         "max_turns": 3}]})
    task, calculator = config.build_tasks()["calc_chat"], TASKS["calculator"]
    assert isinstance(task.agent, EnvAgent) and task.agent.max_turns == 3 and task.reward == "env"
    rng = random.Random(1)
    assert task.sample(rng, 1) == calculator.sample(random.Random(1), 1)  # the environment's own problems
    assert task.heldout(5) == calculator.heldout(5)
    problem = next(p for p in calculator.heldout(50) if len(calculator.sft_turns(p)) == 2)  # one that calls the tool
    expression, answer = problem.prompt.removesuffix("="), problem.answer
    assert task.demonstration(problem) == [
        {"role": "user", "content": problem.prompt}, {"role": "assistant", "content": f"call {expression}"},
        {"role": "user", "content": f"= {answer}\n"}, {"role": "assistant", "content": answer}]
    _, completion, trained = demonstration_ids(task, problem, TOKENIZER)
    sampled = [t for t, k in zip(completion, trained, strict=True) if k]
    decoded = TOKENIZER.backend.decode(sampled, skip_special_tokens=False)
    assert decoded == f"call {expression}<|im_end|>{answer}<|im_end|>"
    assert config.has_agents
    for bad, needle in [({"environment": "calculator", "agent": "examples.calculator_agent:run"}, "exactly one"),
                        ({"environment": "arithmetic"}, "not a multi-turn task"),
                        ({"environment": "calculator", "path": "data/agent_calc.jsonl"}, "path")]:
        with pytest.raises(ConfigError, match=needle):
            validate_config({"model": {"tokenizer": BPE_AGENT, "chat_template": True},
                             "tasks": [{"kind": "agent", "name": "calc_chat", **bad}]})
