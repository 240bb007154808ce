"""The TRL side of `jetroll bench peers`: TRL's GRPOTrainer on a jetroll job's base model, problems and reward, in a
process of its own: `python -m jetroll.bench.trl_grpo SPEC.json`.

Everything the algorithm shares with the job is read from the job's config, so the two sides differ only in how they
run it:
- the base: the job's HF-format base directory, through `AutoModelForCausalLM`, and its tokenizer file (and chat
  template) through `PreTrainedTokenizerFast`; the prompt ids TRL makes are checked equal to jetroll's;
- the prompts: plain text, or with `model.chat_template: true` the same messages jetroll renders (system prompt
  included), which TRL renders with the same template;
- the problems: the job's own draws (`Admission.draw`), groups 1 .. steps x B, in admission order
  (`shuffle_dataset=False`);
- the reward: the task's reward function, by name;
- `trainer.updates_per_batch` optimizer steps (TRL's `num_iterations`) per batch of B prompts x G samples, sampled
  fresh at the job's temperature over the whole vocabulary (`top_p=1`, `top_k=0`);
- Dr.GRPO (`loss_type="dr_grpo"`: the loss over batch x max_completion_length; `scale_rewards="none"`: r - mean),
  `beta` = the job's kl_coef, the job's clip bounds;
- AdamW with the job's lr schedule per step (`trainer_lr` in a `LambdaLR`), weight decay and grad clip; fp32.

The clock: `steps.jsonl` records each step's end (wall and this process's CPU seconds) with the time spent writing
the weight snapshots taken out, so evaluation (of the snapshots, afterwards) is off the clock, as it is on jetroll's
side.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from jetroll.functions.scoring import job_tasks
from jetroll.shared.config.job import JobConfig, load_config
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.rl.admission import Admission, admission_window
from jetroll.shared.rl.schedule import trainer_lr
from jetroll.shared.tasks.base import Problem
from jetroll.shared.tasks.registry import TaskSet

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def job_problems(config: JobConfig, tasks: TaskSet, num_groups: int) -> list[tuple[str, Problem]]:
    """The task names and problems of the job's groups 1 .. num_groups, drawn as its controller draws them."""
    admission = Admission(config.trainer.groups_per_step, admission_window(config), config.trainer.max_steps,
                          task_weights={t.name: t.weight for t in config.tasks})
    drawn = []
    for index in range(1, num_groups + 1):
        draw = admission.draw(tasks, config.seed, index, {})
        assert draw is not None, "no per-task caps here, so every draw names a task"
        task, problem = draw
        drawn.append((task.name, problem))
    return drawn


def trl_prompt_ids(tokenizer: PreTrainedTokenizerFast, prompt: str | list[dict[str, str]]) -> list[int]:
    """The ids GRPOTrainer generates from (its `_tokenize_prompts`)."""
    if isinstance(prompt, str):
        return tokenizer(text=[prompt])["input_ids"][0]
    return tokenizer.apply_chat_template(conversation=[prompt], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"][0]


def completion_text(completion: str | list[dict[str, str]]) -> str:
    """A completion as text: TRL passes a conversational prompt's completion as one assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def grpo_settings(config: JobConfig, steps: int, seed: int, out_dir: Path,
                  max_completion_length: int) -> dict[str, Any]:
    """GRPOConfig's arguments: the job's algorithm (module docstring), nothing that reuses samples across steps."""
    trainer = config.trainer
    return {
        "output_dir": str(out_dir), "seed": seed, "num_train_epochs": 1,
        # TRL counts optimizer updates as steps: each batch is trained num_iterations times
        "max_steps": steps * trainer.updates_per_batch, "num_iterations": trainer.updates_per_batch,
        "per_device_train_batch_size": trainer.groups_per_step * trainer.group_size,
        "num_generations": trainer.group_size, "gradient_accumulation_steps": 1, "steps_per_generation": 1,
        "shuffle_dataset": False,
        "max_completion_length": max_completion_length,
        "temperature": config.rollout.temperature, "top_p": 1.0, "top_k": 0,
        "loss_type": "dr_grpo", "scale_rewards": "none", "beta": trainer.kl_coef,
        "epsilon": trainer.clip_eps, "epsilon_high": trainer.clip_eps_high,
        "learning_rate": trainer.lr, "weight_decay": trainer.weight_decay, "max_grad_norm": trainer.grad_clip,
        "bf16": False, "fp16": False, "use_cpu": True, "gradient_checkpointing": False, "use_vllm": False,
        "logging_steps": 10, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def run(spec: dict[str, Any]) -> None:
    torch.set_num_threads(spec["threads"])
    config = load_config(Path(spec["config"]), spec["overrides"])
    if len(config.tasks) != 1:
        raise SystemExit("bench peers: the TRL side runs single-task jobs only")
    base, out = Path(spec["base_dir"]), Path(spec["out_dir"])
    steps, snapshot_every = spec["steps"], spec["snapshot_every"]
    names = json.loads((base / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(base / "tokenizer.json"), eos_token=names["eos_token"],
                                        pad_token=names["pad_token"], chat_template=names.get("chat_template"))
    prompt_format = PromptFormat.of(config.model, load_tokenizer(base))
    tasks = job_tasks(config)
    drawn = job_problems(config, tasks, steps * config.trainer.groups_per_step)
    # TRL takes a conversational prompt as messages, which it renders with the template itself
    rows = [{"prompt": problem.prompt if prompt_format.template is None else prompt_format.messages(problem),
             "answer": problem.answer, "task": task} for task, problem in drawn]
    for row, (_, problem) in zip(rows[:1000], drawn, strict=False):  # TRL's prompt ids must be jetroll's
        if trl_prompt_ids(tokenizer, row["prompt"]) != prompt_format.ids(problem):
            raise SystemExit(f"bench peers: TRL makes other prompt ids than jetroll's for {row['prompt']!r}")
    first = tasks[config.tasks[0].name]
    reward_fn = tasks.reward_fn(first)
    budget = config.rollout.sample_budget(first.max_new_tokens)

    def reward(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        return [reward_fn(completion_text(c), a).reward for c, a in zip(completions, answer, strict=True)]

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.trainer.lr, weight_decay=config.trainer.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: trainer_lr(config.trainer, step) / config.trainer.lr)
    clock = StepClock(out, base, snapshot_every, config.trainer.updates_per_batch)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, processing_class=tokenizer,
                          args=GRPOConfig(**grpo_settings(config, steps, spec["seed"], out / "trl", budget)),
                          train_dataset=Dataset.from_list(rows), optimizers=(optimizer, schedule),
                          callbacks=[clock])
    clock.snapshot(trainer.model, 0)
    clock.start()
    trainer.train()


class StepClock(TrainerCallback):
    """Records each batch's end (TRL's step is an optimizer update: a batch takes `updates_per_batch`) and the logs,
    and every `snapshot_every`-th batch's weights as an HF directory that jetroll's evaluation loads."""

    def __init__(self, out: Path, base: Path, snapshot_every: int, updates_per_batch: int) -> None:
        self.out, self.base, self.snapshot_every = out, base, snapshot_every
        self.updates_per_batch = updates_per_batch
        self.steps = open(out / "steps.jsonl", "w")  # open for the whole run
        self.logs = open(out / "logs.jsonl", "w")
        self.off_wall = self.off_cpu = 0.0

    def start(self) -> None:
        self._write(self.steps, {"step": 0, **self._now()})

    def _now(self) -> dict[str, float]:
        return {"wall_s": time.perf_counter() - self.off_wall, "cpu_s": time.process_time() - self.off_cpu}

    @staticmethod
    def _write(file: Any, row: dict[str, Any]) -> None:
        file.write(json.dumps(row) + "\n")
        file.flush()

    def snapshot(self, model: torch.nn.Module, step: int) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        directory = self.out / "snapshots" / f"step-{step}"
        directory.mkdir(parents=True)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        for name in MODEL_FILES:
            (directory / name).write_bytes((self.base / name).read_bytes())
        self.off_wall += time.perf_counter() - wall
        self.off_cpu += time.process_time() - cpu

    def on_step_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                    **_: Any) -> None:
        batches, within = divmod(state.global_step, self.updates_per_batch)
        if within:
            return
        self._write(self.steps, {"step": batches, **self._now()})
        if batches % self.snapshot_every == 0 or state.global_step == state.max_steps:
            self.snapshot(model, batches)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        self._write(self.logs, {"step": state.global_step / self.updates_per_batch, **(logs or {})})


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
