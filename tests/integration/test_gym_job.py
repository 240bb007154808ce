"""A `kind: gymnasium` job end to end: FrozenLake episodes run in the rollout worker against gymnasium's own
environment, their observations go into the trajectory unsampled, and the reward replays each transcript through the
same environment, agreeing with what the environment said during the episode."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path

import pytest
from helpers import JETROLL
from job_harness import hold_streams

from jetroll.functions.builtin import gymnasium_reward
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import ScoredEvent, decode
from jetroll.shared.tasks.gym_text import GymEnv, GymProblem, text_adapter

pytestmark = pytest.mark.integration
pytest.importorskip("gymnasium", reason="kind: gymnasium needs the gym extra")
REPO = Path(__file__).resolve().parents[2]
TOKENIZER = build_char_tokenizer()


@pytest.mark.slow  # about a minute: a 150-step warm start on the solver's paths, then 3 steps
def test_frozenlake_job_end_to_end(redis_url: str, tmp_path: Path) -> None:
    job = f"f{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    cmd = [*JETROLL, "run", str(REPO / "configs" / "smoke.yaml"), "--redis-url", redis_url, "--run-dir", str(run_dir),
           "--set", "tasks=[{kind: gymnasium, name: frozenlake, max_turns: 8}]", "--set", "rollout.max_seq_len=128",
           "--set", "model.warm_start.max_steps=150", "--set", f"model.cache_dir={tmp_path / 'cache'}",
           "--set", "trainer.max_steps=3", "--set", f"job_id={job}"]
    hold_streams(redis_url, job, "traj:scored")
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["dead_letters"] == {}

    async def scored() -> list[ScoredEvent]:
        bus = RedisBus(redis_url, job)
        try:
            return [e for _, f in await bus.redis.xrange(bus.key("traj:scored"))
                    if isinstance(e := decode(f[b"e"]), ScoredEvent)]
        finally:
            await bus.close()

    events = asyncio.run(scored())
    assert len(events) >= 3 * 4 * 4
    num_moves, texts = 0, []
    for event in events:
        traj = event.trajectory
        assert traj.task == "frozenlake" and traj.env_status == "ok" and event.status == "ok"
        completion, mask = traj.completion_ids.numpy().tolist(), traj.loss_mask.numpy().tolist()
        text = TOKENIZER.decode(completion)
        # each model turn replayed through a fresh environment gives back the observations the episode appended
        problem = GymProblem.parse(traj.answer)
        env = GymEnv(text_adapter(problem.env_id, problem.adapter_options), "\n", problem.max_turns)
        env.start(problem.options)
        observations, step = [], None
        turns = text.split("\n")[::2]
        for i, turn in enumerate(turns):
            step = env.advance(turn)
            if step.done:
                break
            # a last turn that ended with EOS (or the budget) gets no observation: the episode is over
            observations.append(step.observation if i < len(turns) - 1 or text.endswith("\n") else "")
        num_moves += len(observations) + 1
        texts.append(text)
        assert TOKENIZER.decode([t for t, m in zip(completion, mask, strict=True) if m == 0]) == "".join(observations)
        # the trained reward is the environment's own, wherever the episode ended
        assert event.reward == gymnasium_reward(text, traj.answer).reward
        if step is not None and step.done:
            assert traj.env_reward == event.reward
    assert num_moves > 1.5 * len(events), texts[:8]  # the warm-started model walks several steps an episode

    # `jetroll eval` plays a multi-turn task's episodes again: the job's own figure on held-out maps, and training maps
    evals = {e["version"]: e["frozenlake"] for e in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())}
    for split in ("heldout", "train"):
        again = subprocess.run([*JETROLL, "eval", str(run_dir), "--json", "--versions", "3", "--split", split],
                               cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        (row,) = json.loads(again.stdout)["rows"]
        assert row["num_problems"] == {"frozenlake": 20}  # configs/smoke.yaml's eval.num_problems
        if split == "heldout":
            assert row["frozenlake"] == evals[3]
