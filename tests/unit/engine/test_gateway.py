"""The agents' gateway, served by a real aiohttp server in front of jetroll's engine and driven by the real `openai`
client: a multi-turn chat with tools whose sampled ids stay as sampled (BPE, where re-tokenizing would change them),
log-probs that are the trainer's, and a 4xx for every bad request, while the session goes on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch

from examples.calculator_agent import CALCULATOR
from examples.calculator_agent import run as calculator_agent
from jetroll.shared.agents.client import InlineAgents
from jetroll.shared.agents.gateway import Gateway
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import EnvResult, Request
from jetroll.shared.engine.turns import TurnRunner, run_episodes
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.chat import render_chat
from jetroll.shared.model.checkpoint import load_pretrained, save_pretrained
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.numerics import Numerics
from jetroll.shared.rl.passes import proximal_pass
from jetroll.shared.tasks.agent import EnvAgent
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.calculator import CalculatorTask

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[3]
TOKENIZER = load_tokenizer(REPO / "configs" / "models" / "bpe-agent")
EOS = TOKENIZER.eos_id
PROBLEM = Problem("Ann has 12 boxes of 34 pens. How many pens is that?", "408")
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
# the model spells its call a character at a time: the canonical encoding of that text is other, fewer ids
CALL_TURN = [i for char in CALL_TEXT for i in TOKENIZER.encode(char)] + [EOS]
ANSWER_TURN = TOKENIZER.encode("The answer is 408.") + [EOS]


def tiny_model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelArgs(vocab_size=TOKENIZER.vocab_size, hidden_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, intermediate_size=256, max_position_embeddings=512,
                              eos_token_id=EOS)).eval()


class ScriptedEngine(Engine):
    """Samples the scripted turns in order (then repeats the last), whatever the model prefers; the recorded
    log-probs stay the model's."""

    turns = [CALL_TURN, ANSWER_TURN]

    def _choose(self, batch: list[Request], logprobs: torch.Tensor) -> torch.Tensor:
        tokens = []
        for request in batch:
            start, length = request.observations[-1] if request.observations else (0, 0)
            turn = self.turns[min(len(request.observations), len(self.turns) - 1)]
            tokens.append(turn[min(len(request.output_ids) - start - length, len(turn) - 1)])
        return torch.tensor(tokens)


Agent = Callable[[Problem, openai.AsyncOpenAI], Awaitable[Any]]


def serve(agent: Agent, model: CausalLM | None = None, *, num_episodes: int = 1, budget: int = 200,
          deadline_s: float = 20.0, env_timeout_s: float = 10.0, max_len: int = 512,
          engine_class: type[Engine] = ScriptedEngine) -> tuple[list[Request], dict[str, EnvResult]]:
    """Run `num_episodes` episodes of `agent` through a gateway in front of the engine, as a rollout worker does."""
    engine = engine_class(model or tiny_model(), EOS, max_batch=max(num_episodes, 1), max_len=max_len)
    requests = [Request(f"g0:{i}", [EOS], budget, temperature=1.0, turn_end_id=EOS) for i in range(num_episodes)]

    async def main() -> dict[str, EnvResult]:
        gateway = Gateway(TOKENIZER, max_len, temperature=1.0, top_p=1.0)
        await gateway.start()
        runner = TurnRunner(engine, TOKENIZER, env_timeout_s, max_retries=0)
        agents = InlineAgents(agent, deadline_s + 5)  # the session's deadline comes first
        for request in requests:
            session = gateway.open(request.request_id, budget, deadline_s)
            runner.start(request, session, PROBLEM)
            agents.launch(session.url, PROBLEM)
        try:
            await run_episodes(engine, runner)
            await agents.drain()
        finally:
            await gateway.close()
        return {r.request_id: runner.env_result(r.request_id) for r in requests}

    return requests, asyncio.run(main())


def test_a_tool_using_agent_on_the_openai_client_gets_the_ids_the_engine_sampled() -> None:
    seen: list[Any] = []

    async def agent(problem: Problem, client: openai.AsyncOpenAI) -> float:
        seen.append(await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": problem.prompt}], tools=[CALCULATOR], logprobs=True))
        call = seen[0].choices[0].message.tool_calls[0]
        messages = [{"role": "user", "content": problem.prompt}, seen[0].choices[0].message.model_dump(),
                    {"role": "tool", "tool_call_id": call.id, "content": "408"}]
        seen.append(await client.chat.completions.create(model="any", messages=messages, tools=[CALCULATOR]))
        return 1.0 if seen[1].choices[0].message.content == "The answer is 408." else 0.0

    (request,), env = serve(agent)
    first, second = seen
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12*34"}
    assert second.choices[0].message.content == "The answer is 408." and second.choices[0].finish_reason == "stop"
    assert env[request.request_id] == EnvResult("ok", 1.0)

    # the prompt is the template's rendering of the first request, tools included, tokenized once
    assert request.prompt_ids == TOKENIZER.encode(render_chat(
        TOKENIZER.chat_template, [{"role": "user", "content": PROBLEM.prompt}], TOKENIZER.special_tokens(),
        tools=[CALCULATOR]))
    # each turn's ids are what the engine sampled; the tool result is the template's own text, loss mask 0
    observation = TOKENIZER.encode("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    assert first.model_extra["token_ids"] == CALL_TURN and second.model_extra["token_ids"] == ANSWER_TURN
    assert request.output_ids == CALL_TURN + observation + ANSWER_TURN
    assert request.loss_mask == [1] * len(CALL_TURN) + [0] * len(observation) + [1] * len(ANSWER_TURN)
    assert TOKENIZER.encode(TOKENIZER.decode(CALL_TURN[:-1])) != CALL_TURN[:-1]  # re-tokenizing changes them
    # the client's log-probs are the engine's mu, token for token
    assert [c.logprob for c in first.choices[0].logprobs.content] == request.logprobs[:len(CALL_TURN)]
    assert first.model_extra["weight_versions"] == [0] * len(CALL_TURN)


def test_the_exact_backends_mu_through_the_gateway_is_bitwise_the_trainers(tmp_path: Path) -> None:
    precision = Numerics(mode="fp8_unified", backend="exact")
    save_pretrained(tiny_model(), TOKENIZER, tmp_path, publish=precision)
    rollout_model, _ = load_pretrained(tmp_path, precision)
    trainer_model, _ = load_pretrained(tmp_path, precision.trainer_side())
    requests, env = serve(calculator_agent, rollout_model, num_episodes=2)
    for request in requests:
        assert env[request.request_id] == EnvResult("ok", 1.0) and len(request.observations) == 1
        ids = torch.tensor([request.prompt_ids + request.output_ids])
        trainer, _ = proximal_pass(trainer_model, ids[:, :-1], ids[:, 1:], torch.tensor([1.0]))
        trainer = trainer[0, len(request.prompt_ids) - 1:]
        mask = torch.tensor(request.loss_mask, dtype=torch.bool)
        assert torch.equal(torch.tensor(request.logprobs, dtype=torch.float32)[mask], trainer[mask])


async def post(url: str, body: Any, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        data = raw if raw is not None else json.dumps(body).encode()
        async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
            return response.status, await response.json(content_type=None)


def test_each_bad_request_gets_its_4xx_and_the_session_goes_on() -> None:
    answers: dict[str, tuple[int, str]] = {}

    async def agent(problem: Problem, client: openai.AsyncOpenAI) -> float:
        url = str(client.base_url).rstrip("/")
        chat, base = f"{url}/chat/completions", url.removesuffix("/v1")
        gateway = base.rsplit("/sessions/", 1)[0]
        user = {"role": "user", "content": problem.prompt}

        async def expect(name: str, target: str, body: Any, raw: bytes | None = None) -> None:
            status, reply = await post(target, body, raw)
            answers[name] = (status, reply["error"]["message"] if "error" in reply else "")

        await expect("malformed json", chat, None, raw=b"{not json")
        await expect("oversize", chat, None, raw=b'{"messages": "' + b"x" * (2 << 20) + b'"}')
        await expect("unknown session", f"{gateway}/sessions/nope/v1/chat/completions", {"messages": [user]})
        await expect("temperature", chat, {"messages": [user], "temperature": 0.3})
        await expect("stop", chat, {"messages": [user], "stop": ["\n"]})
        await expect("unknown parameter", chat, {"messages": [user], "frequency_penalty": 0.5})
        await expect("small max_tokens", chat, {"messages": [user], "max_tokens": 4})
        await expect("too long", chat, {"messages": [{"role": "user", "content": "a b " * 400}]})
        # two at once: one waits on the policy, the other is refused
        both = await asyncio.gather(*(post(chat, {"messages": [user], "tools": [CALCULATOR]}) for _ in range(2)))
        (_, refused), = [b for b in both if b[0] == 409]
        answers["concurrent"] = (409, refused["error"]["message"])
        (_, first), = [b for b in both if b[0] == 200]
        sampled = first["choices"][0]["message"]
        tool = {"role": "tool", "tool_call_id": "call_0", "content": "408"}
        await expect("edited history", chat, {"messages": [{**user, "content": "Other question?"}, sampled, tool],
                                              "tools": [CALCULATOR]})
        await expect("truncated history", chat, {"messages": [sampled, tool], "tools": [CALCULATOR]})
        await expect("tools changed", chat, {"messages": [user, sampled, tool]})
        await expect("text on a chat session", f"{url}/completions", {"prompt": "hi"})
        await expect("bad end", f"{base}/end", {"status": "fine", "reward": 2})
        last = await client.chat.completions.create(model="any", messages=[user, sampled, tool], tools=[CALCULATOR])
        assert last.choices[0].message.content == "The answer is 408."
        return 1.0

    (request,), env = serve(agent)
    assert env[request.request_id] == EnvResult("ok", 1.0)  # every refusal left the session going
    expected = {
        "malformed json": (400, "not JSON"), "oversize": (413, "at most"), "unknown session": (404, "no session"),
        "temperature": (400, "samples at temperature 1"), "stop": (400, "stop strings"),
        "unknown parameter": (400, "frequency_penalty"), "small max_tokens": (400, "remaining budget"),
        "too long": (400, "context is 512"), "edited history": (400, "messages[0] has other content"),
        "truncated history": (400, "messages[0] has role 'assistant'"), "tools changed": (400, "tools are fixed"),
        "text on a chat session": (400, "chat session"), "bad end": (400, "status must be"),
        "concurrent": (409, "one at a time"),
    }
    for name, (status, needle) in expected.items():
        assert answers[name][0] == status and needle in answers[name][1], (name, answers[name])


def test_an_ended_session_answers_410_and_a_session_past_its_deadline_ends_as_a_timeout() -> None:
    codes: list[int] = []

    async def ends_then_asks(problem: Problem, client: openai.AsyncOpenAI) -> float:
        user = {"role": "user", "content": problem.prompt}
        await client.chat.completions.create(model="any", messages=[user])
        status, _ = await post(str(client.base_url).rstrip("/").removesuffix("/v1") + "/end",
                               {"status": "ok", "reward": 0.5})
        await asyncio.sleep(0.5)  # the episode ends on the rollout side meanwhile
        try:
            await client.chat.completions.create(model="any", messages=[user])
        except openai.APIStatusError as error:
            codes.append(error.status_code)
        return 1.0  # its launcher's end comes too late: the session kept the first

    async def slow(problem: Problem, client: openai.AsyncOpenAI) -> float:
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": problem.prompt}])
        await asyncio.sleep(2.0)  # past the session's 1 s deadline
        try:
            await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "again"}])
        except openai.APIStatusError as error:
            codes.append(error.status_code)
        return 1.0

    (request,), env = serve(ends_then_asks)
    assert env[request.request_id] == EnvResult("ok", 0.5) and codes == [410]
    (request,), env = serve(slow, deadline_s=1.0)
    assert env[request.request_id].status == "timeout" and env[request.request_id].reward is None
    assert codes == [410, 410]


@pytest.mark.parametrize(("behaviour", "status"), [("raises", "error"), ("hangs", "timeout"), ("bad result", "error")])
def test_an_agent_that_raises_or_hangs_is_an_env_status_never_a_reward(behaviour: str, status: str) -> None:
    async def agent(problem: Problem, client: openai.AsyncOpenAI) -> Any:
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": problem.prompt}])
        if behaviour == "raises":
            raise KeyError("the tool crashed")
        if behaviour == "hangs":
            await asyncio.sleep(60)
        return "yes"

    (request,), env = serve(agent, deadline_s=1.5)
    assert env[request.request_id].status == status and env[request.request_id].reward is None


def test_a_text_session_on_v1_completions_extends_its_text() -> None:
    seen: list[Any] = []

    async def agent(problem: Problem, client: openai.AsyncOpenAI) -> float:
        first = await client.completions.create(model="any", prompt="Q: 12*34?\nA:", logprobs=0)
        seen.append(first)
        prompt = "Q: 12*34?\nA:" + first.choices[0].text + "\nresult: 408\n"
        seen.append(await client.completions.create(model="any", prompt=prompt))
        try:
            await client.completions.create(model="any", prompt="Q: edited")
        except openai.BadRequestError as error:
            seen.append(error)
        return 1.0

    (request,), env = serve(agent)
    assert env[request.request_id] == EnvResult("ok", 1.0)
    assert request.prompt_ids == TOKENIZER.encode("Q: 12*34?\nA:")
    assert seen[0].model_extra["token_ids"] == CALL_TURN and seen[1].model_extra["token_ids"] == ANSWER_TURN
    assert seen[0].choices[0].logprobs.token_logprobs == request.logprobs[:len(CALL_TURN)]
    assert request.output_ids == CALL_TURN + TOKENIZER.encode("\nresult: 408\n") + ANSWER_TURN
    assert "differs from the session's text at character 3" in str(seen[2])


def test_a_session_of_an_unknown_or_finished_id_and_a_gateway_without_a_template_are_refused() -> None:
    from jetroll.shared.model.tokenizer import build_char_tokenizer

    with pytest.raises(ValueError, match="chat template"):
        Gateway(build_char_tokenizer(), 64, 1.0, 1.0)
    gateway = Gateway(TOKENIZER, 64, 1.0, 1.0)

    gateway.open("a:0", 10, 1.0)
    with pytest.raises(ValueError, match="already open"):
        gateway.open("a:0", 10, 1.0)


def test_the_gateway_listens_where_rollout_gateway_host_says_and_is_reached_there() -> None:
    async def main() -> tuple[str, int]:
        gateway = Gateway(TOKENIZER, 64, 1.0, 1.0, host="localhost")
        try:
            url = await gateway.start()
            async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as response:
                return url, response.status
        finally:
            await gateway.close()

    url, status = asyncio.run(main())
    assert url.startswith("http://localhost:") and status == 200


def test_the_stock_loop_plays_a_reset_step_environment_through_the_chat_endpoint() -> None:
    """An environment without an agent (the calculator's) on the gateway path: the stock loop sends the prompt, steps
    each turn's content through the environment and sends its observation as the next user message."""

    class CalculatorTurns(ScriptedEngine):
        turns = [TOKENIZER.encode("call 12*34") + [EOS], TOKENIZER.encode("408") + [EOS]]

    (request,), env = serve(EnvAgent(CalculatorTask().make_env, max_turns=4), engine_class=CalculatorTurns)
    assert env[request.request_id] == EnvResult("ok", 1.0)  # the environment's own reward, the trained one
    observation = TOKENIZER.encode("\n<|im_start|>user\n= 408\n<|im_end|>\n<|im_start|>assistant\n")
    assert request.output_ids == CalculatorTurns.turns[0] + observation + CalculatorTurns.turns[1]
    assert request.prompt_ids == TOKENIZER.encode(render_chat(
        TOKENIZER.chat_template, [{"role": "user", "content": PROBLEM.prompt}], TOKENIZER.special_tokens()))
