"""How a FrozenLake model fails: greedy episodes on the 200 held-out maps of a job's FrozenLake task, as `jetroll eval`
plays them, each transcript replayed move by move on its map: reached the goal, stepped into a hole, or neither
(out of turns or tokens).

usage: python replay.py RUN_DIR WEIGHTS_DIR  (a version directory of the run's store, e.g. .../weights/v00001000)
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

from jetroll.functions.runner import REWARDS
from jetroll.shared.config.job import load_config
from jetroll.shared.evaluate import greedy_completions
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.checkpoint import load_pretrained
from jetroll.shared.tasks.gym_text import GymProblem

MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def outcome(transcript: str, options: str) -> str:
    rows = options.split("/")
    row = col = 0
    for move in re.findall(r"^(left|down|right|up)$", transcript, re.M):
        r, c = row + MOVES[move][0], col + MOVES[move][1]
        if 0 <= r < len(rows) and 0 <= c < len(rows[0]):  # a move off the map stays put
            row, col = r, c
        if rows[row][col] in "hg":
            return {"h": "hole", "g": "goal"}[rows[row][col]]
    return "neither"


def main(run_dir: Path, weights: Path) -> None:
    config = load_config(run_dir / "config.json", [])
    task = config.build_tasks()["frozenlake"]
    problems = task.heldout(200)
    model, tokenizer = load_pretrained(weights, config.precision.numerics())
    transcripts = greedy_completions(model, tokenizer, problems, task.max_new_tokens, task=task,
                                     prompts=PromptFormat.of(config.model, tokenizer))
    reward = REWARDS[task.reward]
    counts = Counter()
    for problem, transcript in zip(problems, transcripts, strict=True):
        options = GymProblem.parse(problem.answer).options
        counts[(reward(transcript, problem.answer).correct, outcome(transcript, options))] += 1
    print(weights.name, {f"{'solved' if solved else 'failed'}/{how}": n for (solved, how), n in sorted(counts.items())})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
