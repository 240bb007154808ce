"""Can TRL's GRPOTrainer drive FrozenLake through `environment_factory` on a bpe-agent base? Two steps of 8.

    python docs/bench/agentic-trl-probe/probe.py BASE_DIR          # as TRL ships: refused (a template it does not know)
    python docs/bench/agentic-trl-probe/probe.py BASE_DIR qwen3    # with a response template the user sets

BASE_DIR: a base on the bpe-agent tokenizer, e.g. the agentic job's (`jetroll init-model configs/agentic.yaml` prints
it). The four moves are the environment's methods, so TRL exposes them as tools; the reward is the environment's
(`get_reward`). Output of both runs: docs/bench/agentic-trl-probe/README.md.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template

from jetroll.shared.tasks.gym_text import FrozenLakeText

os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
ADAPTER = FrozenLakeText(size=4)


class FrozenLake:
    """FrozenLake-v1 as TRL wants an environment: `reset` returns the map and position, each move is a tool."""

    def __init__(self) -> None:
        self.env: Any = None
        self.reward = 0.0
        self.done = False

    def reset(self, map: str, **_: Any) -> str:
        self.env = ADAPTER.make(map)
        observation, _ = self.env.reset(seed=0)
        self.reward, self.done = 0.0, False
        return f"{map} {ADAPTER.render(self.env, observation)}"

    def _move(self, action: int) -> str:
        if self.done:
            return "the episode is over"
        observation, reward, terminated, truncated, _ = self.env.step(action)
        self.reward, self.done = float(reward), terminated or truncated
        return ADAPTER.render(self.env, observation)

    def left(self) -> str:
        """Move one cell left.

        Returns:
            The new position.
        """
        return self._move(0)

    def down(self) -> str:
        """Move one cell down.

        Returns:
            The new position.
        """
        return self._move(1)

    def right(self) -> str:
        """Move one cell right.

        Returns:
            The new position.
        """
        return self._move(2)

    def up(self) -> str:
        """Move one cell up.

        Returns:
            The new position.
        """
        return self._move(3)

    def get_reward(self) -> float:
        return self.reward


def main(base: Path, response_template: str | None) -> None:
    names = json.loads((base / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(base / "tokenizer.json"), eos_token=names["eos_token"],
                                        pad_token=names["pad_token"], chat_template=names.get("chat_template"))
    if response_template == "qwen3":  # the bpe-agent template writes <tool_call>{json}</tool_call> as Qwen3's does
        tokenizer.response_template = qwen3_template
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": "reach g"}], "map": ADAPTER.draw(rng)} for _ in range(64)]
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    args = GRPOConfig(output_dir="/tmp/trl_probe", max_steps=2, per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=64, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                      max_tool_calling_iterations=8)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=args, train_dataset=Dataset.from_list(rows),
                          environment_factory=FrozenLake)
    trainer.train()
    print(json.dumps(trainer.state.log_history[-2]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
