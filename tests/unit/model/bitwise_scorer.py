"""The trainer's side of the bitwise test, run as its own process: load each published version from its checkpoint
bytes and compute the trainer's no-grad log-probs of the given sequences, in another batch composition and padding.

usage: python bitwise_scorer.py JOB_JSON  (job: checkpoints {version: dir}, precision, sequences, out,
micro_batch, extra_pad, temperature, threads)
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file, save_file

from jetroll.shared.model.checkpoint import load_pretrained
from jetroll.shared.numerics import Numerics
from jetroll.shared.rl.passes import proximal_pass


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    torch.set_num_threads(job["threads"])
    precision = Numerics(**job["precision"]).trainer_side()
    sequences = load_file(job["sequences"])
    ids, lengths = sequences["ids"], sequences["lengths"].tolist()
    order = list(reversed(range(len(lengths))))  # another batch composition than rollout's
    out = {}
    for version, directory in job["checkpoints"].items():
        model, tokenizer = load_pretrained(directory, precision)
        logprobs = torch.zeros(ids.shape, dtype=torch.float32)
        for start in range(0, len(order), job["micro_batch"]):
            rows = order[start : start + job["micro_batch"]]
            width = max(lengths[i] for i in rows) - 1 + job["extra_pad"]
            input_ids = torch.full((len(rows), width), tokenizer.pad_id)
            targets = torch.full((len(rows), width), tokenizer.pad_id)
            for j, i in enumerate(rows):
                input_ids[j, : lengths[i] - 1] = ids[i, : lengths[i] - 1]
                targets[j, : lengths[i] - 1] = ids[i, 1 : lengths[i]]
            temperature = torch.full((len(rows),), job["temperature"])
            scored, _ = proximal_pass(model, input_ids, targets, temperature)
            for j, i in enumerate(rows):
                logprobs[i, : lengths[i] - 1] = scored[j, : lengths[i] - 1]
        out[f"v{version}"] = logprobs
    save_file(out, job["out"])


if __name__ == "__main__":
    main(sys.argv[1])
