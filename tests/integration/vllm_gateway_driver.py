"""Runs agent episodes through the gateway in front of the vllm engine, in a process of its own (see vllm_driver.py
for why), and prints what each episode's requests and responses held, as JSON: `python vllm_gateway_driver.py MODEL
REPO N`. The agent is the calculator agent's loop, recording each response's `token_ids` and log-probs."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from jetroll.shared.agents.client import InlineAgents
from jetroll.shared.agents.gateway import Gateway
from jetroll.shared.engine.request import Request
from jetroll.shared.engine.turns import TurnRunner, run_episodes
from jetroll.shared.engine.vllm import VllmEngine
from jetroll.shared.model.checkpoint import read_args
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.tasks.base import Problem

MAX_LEN = 320


def main(model: Path, repo: Path, num_episodes: int) -> dict[str, Any]:
    sys.path.insert(0, str(repo))
    from examples.calculator_agent import TOOLS, call_tool

    args, _ = read_args(model)
    tokenizer = load_tokenizer(model)
    engine = VllmEngine(model, args, tokenizer.vocab_size, "fp32", max_batch=num_episodes, max_len=MAX_LEN, seed=5)
    rows = [json.loads(line) for line in (repo / "data" / "agent_calc.jsonl").read_text().splitlines()[:num_episodes]]
    responses: dict[str, list[dict[str, Any]]] = {}

    async def agent(problem: Problem, client: Any) -> float:
        turns = responses.setdefault(problem.prompt, [])
        messages: list[dict[str, Any]] = [{"role": "user", "content": problem.prompt}]
        for _ in range(3):
            response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                            logprobs=True)
            choice = response.choices[0]
            turns.append({"token_ids": response.model_extra["token_ids"], "finish_reason": choice.finish_reason,
                          "logprobs": [c.logprob for c in choice.logprobs.content]})
            messages.append(choice.message.model_dump(exclude_none=True))
            if not choice.message.tool_calls:
                break
            for call in choice.message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": call_tool(call.function.name, call.function.arguments)})
        return 1.0 if messages[-1].get("content") == f"The answer is {problem.answer}." else 0.0

    requests = [Request(f"e{i}", [tokenizer.eos_id], 96, temperature=1.0, turn_end_id=tokenizer.eos_id)
                for i in range(len(rows))]

    async def run() -> list[dict[str, Any]]:
        gateway = Gateway(tokenizer, MAX_LEN, temperature=1.0, top_p=1.0)
        await gateway.start()
        agents = InlineAgents(agent, 60.0)
        runner = TurnRunner(engine, tokenizer, 60.0, max_retries=0)
        for request, row in zip(requests, rows, strict=True):
            session, problem = gateway.open(request.request_id, 96, 60.0), Problem(row["question"], row["answer"])
            runner.start(request, session, problem)
            agents.launch(session.url, problem)
        try:
            await run_episodes(engine, runner)
            await agents.drain()
        finally:
            await gateway.close()
        return [{"status": r.status, "reward": r.reward} for r in map(runner.env_result, [q.request_id
                                                                                              for q in requests])]

    results = asyncio.run(run())
    return {"episodes": [
        {"prompt_ids": r.prompt_ids, "output_ids": r.output_ids, "loss_mask": r.loss_mask, "logprobs": r.logprobs,
         "versions": r.versions, "finish_reason": r.finish_reason, "responses": responses.get(row["question"], []),
         **result} for r, row, result in zip(requests, rows, results, strict=True)]}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))))
