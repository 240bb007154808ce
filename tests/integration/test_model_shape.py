"""A real-vocabulary job: Qwen2.5-0.5B's width and vocabulary (151,936) with 2 layers and random weights
(`model.init: random`), one RL step end to end through every service, as `jetroll bench shape` runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetroll.bench.shape import run_shape_bench
from jetroll.shared.model.checkpoint import read_weights

pytestmark = pytest.mark.integration

GIB = 1024**3


@pytest.mark.slow
def test_a_real_vocabulary_job_trains_a_step_within_8_gb(tmp_path: Path) -> None:
    result = run_shape_bench(layers=2, max_steps=1, run_dir=tmp_path)
    assert result["config"]["vocab_size"] == 151_936 and result["config"]["hidden_size"] == 896
    assert set(result["peak_rss_gib"]) >= {"run", "controller", "trainer", "rollout", "reward", "redis"}
    assert result["peak_rss_together_gib"] <= 8.0, result
    [step] = result["steps"]
    assert step["step"] == 1 and step["step_time_s"] > 0
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["grad_rows_frac"] == 1.0 and metrics["grad_norm"] > 0  # the KL term gives every sample a gradient
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["accuracy_before"] is None  # eval.num_problems 0: no eval at all
    [published] = [p for p in (run / "store").rglob("config.json") if p.parent.name == "v00000001"]
    assert json.loads(published.read_text())["vocab_size"] == 151_936
    weights = read_weights(published.parent)
    assert weights["model.embed_tokens.weight"].shape == (151_936, 896)
