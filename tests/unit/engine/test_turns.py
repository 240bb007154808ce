"""Multi-turn episodes in the engine: observations appended with loss_mask 0 and the right versions, the KV cache
continued after them, and a slow, hanging or failing environment that never holds up the other sequences."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import EnvResult, Request
from jetroll.shared.engine.turns import EnvCounts, TurnRunner, run_episodes
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_pretrained, save_pretrained
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import Tokenizer, build_char_tokenizer, load_tokenizer
from jetroll.shared.numerics import Numerics
from jetroll.shared.rl.passes import proximal_pass
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.env import EnvStep

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = build_char_tokenizer()
TURN_END = TOKENIZER.encode("\n")[0]
TURN = TOKENIZER.encode("12") + [TURN_END]  # what every model turn says (ScriptedEngine)
PROBLEM = Problem("7*8=", "56")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=TOKENIZER.vocab_size, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=256, max_position_embeddings=256, eos_token_id=TOKENIZER.eos_id)
    model = CausalLM(args).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.2)
    return model


class ScriptedEngine(Engine):
    """Every model turn is `turn` (`12` and the turn end), whatever the model prefers; the recorded log-probs stay
    the model's, so they check the KV cache as sampled tokens would."""

    turn = TURN

    def _choose(self, batch: list[Request], logprobs: torch.Tensor) -> torch.Tensor:
        tokens = []
        for request in batch:
            start, length = request.observations[-1] if request.observations else (0, 0)
            tokens.append(self.turn[min(len(request.output_ids) - start - length, len(self.turn) - 1)])
        return torch.tensor(tokens)


class ScriptedEnv:
    """Observes `= <k>` after turn k, done after `num_steps` turns; may be slow, hang, or fail its reset or steps."""

    def __init__(self, num_steps: int = 2, delay_s: float = 0.0, num_failures: int = 0, hang: bool = False,
                 is_reset_failing: bool = False, observation: str = "= {k}\n", reset_delay_s: float = 0.0) -> None:
        self.num_steps, self.delay_s, self.num_failures, self.hang = num_steps, delay_s, num_failures, hang
        self.is_reset_failing, self.observation, self.reset_delay_s = is_reset_failing, observation, reset_delay_s
        self.turns: list[str] = []
        self.answered_at: list[float] = []

    async def reset(self, problem: Problem) -> None:
        await asyncio.sleep(self.reset_delay_s)
        if self.is_reset_failing:
            raise ConnectionError("sandbox unavailable")

    async def step(self, turn: str) -> EnvStep:
        if self.hang:
            await asyncio.sleep(60)
        if self.num_failures:
            self.num_failures -= 1
            raise RuntimeError("tool crashed")
        await asyncio.sleep(self.delay_s)
        self.turns.append(turn)
        self.answered_at.append(time.monotonic())
        k = len(self.turns)
        is_done = k >= self.num_steps
        return EnvStep(self.observation.format(k=k), done=is_done, reward=0.5 if is_done else None)


def episode_requests(n: int, max_new_tokens: int = 40) -> list[Request]:
    return [Request(f"r{i}", TOKENIZER.encode(f"{i}*{i + 3}="), max_new_tokens, turn_end_id=TURN_END) for i in range(n)]


@dataclass
class Ran:
    finished_at: dict[str, float]  # each request's finish time
    env: dict[str, EnvResult]  # what each episode's environment reported, as the worker takes it
    counts: EnvCounts | None = None  # the runner's, at the end


def run(engine: Engine, requests: list[Request], envs: list[ScriptedEnv], timeout_s: float = 5.0,
        tokenizer: Tokenizer = TOKENIZER) -> Ran:
    """Run the episodes."""
    ran = Ran({}, {})

    async def main() -> None:
        runner = TurnRunner(engine, tokenizer, timeout_s)
        ran.counts = runner.counts
        for request, env in zip(requests, envs, strict=True):
            runner.start(request, env, PROBLEM)
        def stamp(ended: list[Request]) -> None:
            for request in ended:
                ran.finished_at[request.request_id] = time.monotonic()
                ran.env[request.request_id] = runner.env_result(request.request_id)

        while engine.has_work or runner.num_pending:  # run_episodes, stamping finish times
            stamp(runner.apply())
            if engine.has_work:
                stamp(runner.on_step(engine.step()))
                await asyncio.sleep(0)
            elif runner.num_pending and not runner.ready:
                await runner.wait(1.0)

    asyncio.run(main())
    return ran


def full_logprobs(model: CausalLM, request: Request) -> torch.Tensor:
    ids = request.prompt_ids + request.output_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0, len(request.prompt_ids) - 1 :]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(request.output_ids)[:, None])[:, 0]


def assert_policy_logprobs_match(model: CausalLM, request: Request) -> None:
    mask = torch.tensor(request.loss_mask, dtype=torch.bool)
    recorded = torch.tensor(request.logprobs)
    assert torch.allclose(recorded[mask], full_logprobs(model, request)[mask], atol=1e-4, rtol=0), request.request_id


def test_observations_are_masked_tagged_and_continued_from_the_kv_cache() -> None:
    model = tiny_model()
    engine = ScriptedEngine(model, TOKENIZER.eos_id, max_batch=2, max_len=64)
    engine.version = 3
    requests, envs = episode_requests(2), [ScriptedEnv(), ScriptedEnv()]
    ran = run(engine, requests, envs)
    for request, env in zip(requests, envs, strict=True):
        assert TOKENIZER.decode(request.output_ids) == "12\n= 1\n12\n"
        assert env.turns == ["12", "12"] and ran.env[request.request_id] == EnvResult("ok", 0.5)
        assert request.finish_reason == "stop"
        assert request.observations == [(3, 4)]
        assert request.loss_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
        assert request.logprobs[3:7] == [0.0] * 4 and request.versions == [3] * 10
        assert_policy_logprobs_match(model, request)  # the appended observation is in the cache, at its positions
    assert not engine.paused and not engine.running and not engine.resuming


def test_a_bpe_conversation_keeps_the_ids_it_sampled_and_is_never_retokenized() -> None:
    """BPE is not a bijection: a turn sampled a character at a time decodes to text that encodes to other ids. The
    episode keeps the ids the model sampled and appends each observation's own ids, so the log-probs recorded for
    them are the ones the trainer recomputes on exactly these ids."""
    tokenizer = load_tokenizer(REPO / "configs" / "models" / "bpe-math")  # byte-level BPE, as shipped with a job
    turn_text = "the answer is 12"
    turn = [i for char in turn_text for i in tokenizer.encode(char)] + tokenizer.encode("\n")
    assert tokenizer.encode(turn_text) != turn[:-1]  # the canonical encoding is another, shorter sequence

    torch.manual_seed(0)
    model = CausalLM(ModelArgs(vocab_size=tokenizer.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, intermediate_size=128, max_position_embeddings=256,
                               eos_token_id=tokenizer.eos_id)).eval()
    engine = ScriptedEngine(model, tokenizer.eos_id, max_batch=1, max_len=256)
    engine.turn = turn  # spelled a character at a time
    prompt = tokenizer.encode("Sam has 5 apples and buys 7 more. How many now?")
    request = Request("r0", prompt, 200, turn_end_id=turn[-1])
    env = ScriptedEnv(observation="= {k}, said the calculator\n")
    run(engine, [request], [env], tokenizer=tokenizer)

    observation = tokenizer.encode("= 1, said the calculator\n")
    assert env.turns == [turn_text, turn_text]  # the environment reads the turn's text
    assert request.output_ids == turn + observation + turn  # the model's ids and the observation's, as they were
    assert request.loss_mask == [1] * len(turn) + [0] * len(observation) + [1] * len(turn)
    conversation = request.prompt_ids + request.output_ids
    assert tokenizer.encode(tokenizer.decode(conversation)) != conversation  # re-tokenizing would train other tokens
    assert_policy_logprobs_match(model, request)


def test_exact_backend_logprobs_after_an_observation_are_bitwise_the_trainers(tmp_path: Path) -> None:
    precision = Numerics(mode="fp8_unified", backend="exact")
    save_pretrained(tiny_model(), TOKENIZER, tmp_path, publish=precision)
    rollout_model, _ = load_pretrained(tmp_path, precision)
    trainer_model, _ = load_pretrained(tmp_path, precision.trainer_side())
    engine = ScriptedEngine(rollout_model, TOKENIZER.eos_id, max_batch=3, max_len=64)
    requests = episode_requests(3)
    run(engine, requests, [ScriptedEnv(num_steps=3, delay_s=0.01 * i) for i in range(3)])
    for request in requests:
        assert TOKENIZER.decode(request.output_ids) == "12\n= 1\n12\n= 2\n12\n"
        ids = torch.tensor([request.prompt_ids + request.output_ids])
        trainer, _ = proximal_pass(trainer_model, ids[:, :-1], ids[:, 1:], torch.tensor([1.0]))
        trainer = trainer[0, len(request.prompt_ids) - 1 :]
        mask = torch.tensor(request.loss_mask, dtype=torch.bool)
        assert torch.equal(torch.tensor(request.logprobs, dtype=torch.float32)[mask], trainer[mask])


def test_slow_environment_pauses_only_its_sequence() -> None:
    model = tiny_model()
    engine = ScriptedEngine(model, TOKENIZER.eos_id, max_batch=3, max_len=64)
    requests = episode_requests(6)
    envs = [ScriptedEnv(delay_s=1.0)] + [ScriptedEnv() for _ in range(5)]
    ran = run(engine, requests, envs)
    finished_at = ran.finished_at
    slow_answered = envs[0].answered_at[0]
    # the five others took turns in the two slots the paused sequence left, all before its environment answered
    assert all(finished_at[r.request_id] < slow_answered for r in requests[1:])
    assert finished_at["r0"] > envs[0].answered_at[-1]
    for request in requests:
        assert TOKENIZER.decode(request.output_ids) == "12\n= 1\n12\n" and ran.env[request.request_id].status == "ok"
        assert_policy_logprobs_match(model, request)


@pytest.mark.parametrize(("env", "status"), [
    (ScriptedEnv(hang=True), "timeout"),
    (ScriptedEnv(num_failures=2), "error"),
    (ScriptedEnv(is_reset_failing=True), "error"),
    (ScriptedEnv(observation="= CAPS\n"), "error"),  # an observation the vocabulary cannot spell
])
def test_a_failing_environment_ends_its_trajectory_with_a_status(env: ScriptedEnv, status: str) -> None:
    model = tiny_model()
    engine = ScriptedEngine(model, TOKENIZER.eos_id, max_batch=2, max_len=64)
    requests = episode_requests(4)
    started = time.monotonic()
    ran = run(engine, requests, [env] + [ScriptedEnv() for _ in range(3)], timeout_s=0.2)
    finished_at = ran.finished_at
    failed = requests[0]
    assert ran.env["r0"].status == status and failed.finish_reason == "stop"
    assert TOKENIZER.decode(failed.output_ids) == ("" if env.is_reset_failing else "12\n")
    assert finished_at["r0"] - started < 2.0  # two attempts of 0.2 s, not the 60 s hang
    for request in requests[1:]:
        assert TOKENIZER.decode(request.output_ids) == "12\n= 1\n12\n" and ran.env[request.request_id].status == "ok"
    assert not engine.paused and not engine.running and engine.num_free_slots == 2


def test_one_retry_hides_a_single_failure() -> None:
    engine = ScriptedEngine(tiny_model(), TOKENIZER.eos_id, max_batch=2, max_len=64)
    requests, envs = episode_requests(1), [ScriptedEnv(num_failures=1)]
    ran = run(engine, requests, envs, timeout_s=0.2)
    assert ran.env["r0"].status == "ok" and TOKENIZER.decode(requests[0].output_ids) == "12\n= 1\n12\n"


def test_the_runner_counts_failed_calls_by_status_and_each_episodes_setup_share() -> None:
    engine = ScriptedEngine(tiny_model(), TOKENIZER.eos_id, max_batch=4, max_len=64)
    envs = [ScriptedEnv(num_failures=1), ScriptedEnv(hang=True), ScriptedEnv()]
    ran = run(engine, episode_requests(3), envs, timeout_s=0.2)
    counts = ran.counts
    assert counts is not None
    # the retried error is counted though its episode ended ok; the hang timed out on both attempts
    assert counts.failed_calls == {"error": 1, "timeout": 2}
    assert counts.episodes == {"ok": 2, "failed": 1}
    # the failed episode's reset was immediate and its step waited 0.4 s: its set-up is a sliver of its time
    assert 0 <= counts.setup_share_sum["failed"] < 0.1
    slow_reset = run(ScriptedEngine(tiny_model(), TOKENIZER.eos_id, max_batch=2, max_len=64), episode_requests(1),
                     [ScriptedEnv(reset_delay_s=0.3)]).counts
    assert slow_reset is not None and slow_reset.episodes == {"ok": 1}
    assert 0.5 < slow_reset.setup_share_sum["ok"] <= 1.0  # 0.3 s of reset against a few ms of decoding


def test_observation_past_the_budget_ends_the_episode_as_length() -> None:
    engine = ScriptedEngine(tiny_model(), TOKENIZER.eos_id, max_batch=2, max_len=64)
    requests = episode_requests(1, max_new_tokens=7)  # "12\n" + "= 1\n" leaves no room for a model token
    run(engine, requests, [ScriptedEnv()])
    assert requests[0].finish_reason == "length" and TOKENIZER.decode(requests[0].output_ids) == "12\n"
    assert not engine.paused


def test_paused_sequences_survive_slot_moves_and_weight_swaps() -> None:
    """Many episodes through few slots, environments answering in random order, a weight swap mid-run: every
    policy token's log-prob is a full forward of the weights its version names."""
    models = {0: tiny_model(seed=0), 1: tiny_model(seed=5)}
    engine = ScriptedEngine(tiny_model(seed=0), TOKENIZER.eos_id, max_batch=4, max_len=64)  # swaps load into it
    rng = random.Random(0)
    requests = episode_requests(10)
    envs = [ScriptedEnv(num_steps=3, delay_s=rng.uniform(0, 0.03)) for _ in requests]

    async def main() -> None:
        runner = TurnRunner(engine, TOKENIZER, 5.0)
        for request, env in zip(requests, envs, strict=True):
            runner.start(request, env, PROBLEM)
        num_steps, swapped_at = 0, None
        while engine.has_work or runner.num_pending:
            runner.apply()
            if engine.has_work:
                runner.on_step(engine.step())
                num_steps += 1
                # swap mid-run while a sequence is paused: the swap recomputes paused sequences too (waiting for
                # one, not a fixed step, since when environments answer depends on the machine's speed)
                if swapped_at is None and num_steps >= 10 and engine.paused:
                    engine.swap_weights(models[1].state_dict(), version=1)
                    swapped_at = num_steps
            await asyncio.sleep(0.002)
        assert swapped_at is not None, "no sequence was ever paused after step 10"

    asyncio.run(main())
    assert any(0 in r.versions and 1 in r.versions for r in requests)
    for request in requests:
        assert TOKENIZER.decode(request.output_ids) == "12\n= 1\n12\n= 2\n12\n"
        mask = torch.tensor(request.loss_mask, dtype=torch.bool)
        recorded, versions = torch.tensor(request.logprobs), torch.tensor(request.versions)
        for version, model in models.items():
            rows = mask & (versions == version)
            assert torch.allclose(recorded[rows], full_logprobs(model, request)[rows], atol=1e-4, rtol=0)


def test_run_episodes_mixes_multi_turn_and_single_turn_requests() -> None:
    model = tiny_model()
    engine = Engine(model, TOKENIZER.eos_id, max_batch=4, max_len=64)
    single = Request("single", TOKENIZER.encode("1+2="), 6, temperature=0.0, ignore_eos=True)
    engine.add([single])
    multi = Request("multi", TOKENIZER.encode("1*2="), 30, temperature=0.0, turn_end_id=TURN_END)

    async def main() -> list[Request]:
        runner = TurnRunner(engine, TOKENIZER, 5.0)
        runner.start(multi, ScriptedEnv(), PROBLEM)
        return await run_episodes(engine, runner)

    finished = asyncio.run(main())
    assert {r.request_id for r in finished} == {"single", "multi"}
    solo = Request("solo", single.prompt_ids, 6, temperature=0.0, ignore_eos=True)
    Engine(model, TOKENIZER.eos_id, max_batch=1, max_len=64).generate([solo])
    assert solo.output_ids == single.output_ids and single.loss_mask == [1] * 6
    assert multi.finish_reason in ("stop", "length")
    assert_policy_logprobs_match(model, multi)
