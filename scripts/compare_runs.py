"""Compare two scripts/behaviour_check.sh outputs: every non-timing metric step by step, the evals, the final weights
and the base models, for each job both ran. Exit 0 only when all are identical and both ran the same jobs."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

TIMING = {"time_s", "step_time_s", "trainer_wait_s", "trainer_idle_frac", "stale_wait_s", "rollout_busy_slot_s",
          "rollout_slot_s", "rollout_idle_frac", "rollout_tokens_per_s", "pool/default/tokens_per_s",
          "pool/default/num_trajectories", "stage_s", "commit_wait_s", "mismatch_sample_s", "mismatch_wait_s",
          "pool/default/env_setup_share/ok"}


def metrics(run: Path) -> list[dict]:
    rows = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def final_weights(run: Path) -> str:
    versions = [p for p in run.rglob("weights/v*") if (p / "manifest.json").exists()]
    return hashlib.sha256((max(versions, key=lambda p: p.name) / "model.safetensors").read_bytes()).hexdigest()


def jobs_run(out: Path) -> list[str]:
    """The scripts/behaviour_check.sh jobs that ran into `out` (an older script ran only the first two)."""
    return [job for job in ("smoke", "default", "agent", "gym") if (out / job / "metrics.jsonl").is_file()]


def main(a: Path, b: Path) -> int:
    jobs = jobs_run(a)
    same = jobs == jobs_run(b)
    for job in jobs:
        rows_a, rows_b = metrics(a / job), metrics(b / job)
        first = next((i for i, (x, y) in enumerate(zip(rows_a, rows_b, strict=False)) if x != y), None)
        evals = (a / job / "eval.jsonl").read_text() == (b / job / "eval.jsonl").read_text()
        weights = final_weights(a / job) == final_weights(b / job)
        print(f"{job}: {len(rows_a)} / {len(rows_b)} steps, metrics "
              f"{'identical' if rows_a == rows_b else f'differ from step {first}'}, evals "
              f"{'identical' if evals else 'differ'}, final weights {'identical' if weights else 'differ'}")
        same &= rows_a == rows_b and evals and weights
    # the weights' hashes, not their cache folders: a base's cache key may change while its weights do not
    bases = [sorted(line.split()[0] for line in (d / "base.sha256").read_text().splitlines()) for d in (a, b)]
    print(f"base models {'identical' if bases[0] == bases[1] else 'differ'}")
    return 0 if same and bases[0] == bases[1] else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
