"""A whole job on a dataset task through `jetroll run`: a JSONL file with bad rows, the tiny model built on a BPE
tokenizer with a chat template, paths relative to where the job starts. The job finishes and counts the bad rows."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import JETROLL

pytestmark = [pytest.mark.integration, pytest.mark.job]

REPO = Path(__file__).resolve().parents[2]
NUM_BAD = 3


def test_a_dataset_job_with_bad_rows_runs_and_counts_them(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in (REPO / "data" / "math_word.jsonl").read_text().splitlines()[:400]]
    lines = [json.dumps(row) for row in rows]
    lines[10:10] = ['{"question": "truncated', json.dumps({"question": "no answer"}),
                    json.dumps({"question": ["a list"], "answer": "1"})]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "words.jsonl").write_text("\n".join(lines) + "\n")
    config = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    config["model"].update(tokenizer=str(REPO / "configs" / "models" / "bpe-math"), chat_template=True,
                           cache_dir=str(tmp_path / "cache"))
    config["model"]["warm_start"].update(tasks=["words"], max_steps=5)
    config["tasks"] = [{"name": "words", "kind": "dataset", "path": "data/words.jsonl", "prompt_field": "question",
                        "answer_field": "answer", "solution_field": "solution", "reward": "math",
                        "max_new_tokens": 16}]
    config["rollout"]["max_seq_len"] = 64
    config["eval"]["num_problems"] = 100  # more than the ~40 held-out rows: the job scores the rows it has
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    result = subprocess.run([*JETROLL, "run", "job.yaml", "--run-dir", str(run_dir)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{NUM_BAD} bad rows skipped" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == config["trainer"]["max_steps"]
    assert summary["groups_trained_by_task"] == {"words": config["trainer"]["max_steps"] *
                                                 config["trainer"]["groups_per_step"]}
    report = summary["datasets"]["words"]
    assert report["bad_rows"] == NUM_BAD and report["files"] == [str(tmp_path / "data" / "words.jsonl")]
    assert [row.split(": ", 1)[0].rsplit(":", 1)[1] for row in report["first_bad_rows"]] == ["11", "12", "13"]
    assert summary["accuracy_before"] is not None  # scored on the held-out rows by the math reward
    assert 0 < report["heldout_rows"] < 100
    assert summary["num_eval_problems"] == {"words": report["heldout_rows"]}
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["tasks"][0]["path"] == str(tmp_path / "data" / "words.jsonl")
