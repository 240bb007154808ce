"""The tiny base model: a char-level Qwen2-type CausalLM, warm-started by a short supervised pass.

The result is a pure function of `ModelConfig` (seeded init, data and order), cached by the config's hash
under `cache_dir`, and published atomically with `os.rename` so no reader ever sees half a model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from safetensors.torch import load_file

from jetroll.shared.config.model import ModelConfig, WarmStartConfig
from jetroll.shared.errors import WarmStartError
from jetroll.shared.evaluate import accuracy_on
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.checkpoint import load_state, save_pretrained
from jetroll.shared.model.init import init_weights, model_args
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import TOKENIZER_FILES, Tokenizer, build_char_tokenizer, load_tokenizer
from jetroll.shared.rl.schedule import cosine_lr
from jetroll.shared.sft import IGNORE_INDEX, sft_batch
from jetroll.shared.tasks.agent import AgentTask
from jetroll.shared.tasks.base import Task
from jetroll.shared.tasks.dataset import DatasetTask
from jetroll.shared.tasks.gym_text import GymTask
from jetroll.shared.tasks.reasoning import ReasoningGymTask
from jetroll.shared.tasks.registry import TaskSet

WARMSTART_FILE = "warmstart.json"
RANDOM_INIT_FILE = "random_init.json"
RANDOM_INIT_VERSION = 1  # bump when build_random_model's code changes the weights a config builds
RECIPE_VERSION = 3  # bump when the build changes what a config builds (2: stop by accuracy; 3: byte-level tokenizer)


def sft_lr(step: int, num_steps: int, peak_lr: float) -> float:
    """Linear warmup over the first 5% of steps, then cosine decay to 10% of the peak."""
    return cosine_lr(step, num_steps, peak_lr, warmup_steps=max(1, num_steps // 20), final_ratio=0.1)


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f} probe {task.fields[probe]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),  # stdout stays clean for --json output
        disable=not enabled,
    )


def _loss_summary(losses: list[float]) -> dict[str, Any]:
    if not losses:
        return {"first": None, "final": None, "min": None, "curve": []}
    tail = losses[-max(1, len(losses) // 10) :]
    every = max(1, len(losses) // 20)
    return {
        "first": losses[0],
        "final": sum(tail) / len(tail),
        "min": min(losses),
        "curve": [[step, losses[step]] for step in range(0, len(losses), every)],
    }


class _SupervisedPass:
    """The SFT loop as a resumable state: model, optimizer and data RNG, so a rollback replays the same steps."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, tasks: TaskSet, warm: WarmStartConfig,
                 prompts: PromptFormat) -> None:
        self.model = model
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.warm = warm
        self.prompts = prompts
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=warm.lr, betas=(0.9, 0.98), weight_decay=0.01)
        self.rng = random.Random(warm.seed)
        self.step = 0
        self.losses: list[float] = []
        self.probes = {name: tasks[name].probe(warm.probe_problems) for name in warm.tasks}
        self.last_probe: dict[str, float] = {}

    def train_step(self) -> float:
        inputs, targets = sft_batch(self.tokenizer, self.tasks, self.warm.tasks, self.warm.batch_size, self.rng,
                                    self.prompts, self.warm.task_weights)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        for group in self.optimizer.param_groups:
            group["lr"] = sft_lr(self.step, self.warm.max_steps, self.warm.lr)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        self.losses.append(loss.item())
        return self.losses[-1]

    def probe_accuracy_by_task(self) -> dict[str, float]:
        accuracy = {name: accuracy_on(self.model, self.tokenizer, self.tasks, self.tasks[name], problems,
                                    prompts=self.prompts)
                    for name, problems in self.probes.items()}
        self.model.train()
        return accuracy

    def probe_accuracy(self) -> float:
        """Greedy accuracy on the probe sets, the mean over the warm start's tasks (each task's in `last_probe`)."""
        self.last_probe = self.probe_accuracy_by_task()
        return sum(self.last_probe.values()) / len(self.last_probe)

    def snapshot(self) -> dict[str, Any]:
        return {"model": copy.deepcopy(self.model.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "rng": self.rng.getstate(), "step": self.step, "num_losses": len(self.losses)}

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.rng.setstate(snapshot["rng"])
        self.step = snapshot["step"]
        del self.losses[snapshot["num_losses"]:]


def _in_band(accuracy: float, band: tuple[float, float]) -> bool:
    return band[0] <= accuracy <= band[1]


def _probe(sft: _SupervisedPass, bar: Progress, job: TaskID, history: list[list[float]]) -> float:
    accuracy = sft.probe_accuracy()
    history.append([sft.step, accuracy])
    bar.update(job, probe=f"{accuracy:.1%}")
    if not bar.disable and not bar.console.is_terminal:  # a log file gets a line per probe instead of a live bar
        by_task = sft.last_probe
        tasks = f" ({', '.join(f'{name} {a:.1%}' for name, a in by_task.items())})" if len(by_task) > 1 else ""
        bar.console.print(f"warm start: step {sft.step}/{sft.warm.max_steps}: probe accuracy {accuracy:.1%}{tasks}")
    return accuracy


def _train_to_band(sft: _SupervisedPass, bar: Progress, job: TaskID) -> dict[str, Any]:
    """Train until a probe evaluation lands in the band; returns the probe history and how the pass stopped."""
    warm: WarmStartConfig = sft.warm
    band = warm.target_band
    history: list[list[float]] = []
    if band is None:
        while sft.step < warm.max_steps:
            bar.update(job, completed=sft.step + 1, loss=sft.train_step())
        return {"stopped": "max_steps", "probe_history": history}
    low, high = band
    last = sft.snapshot()
    while sft.step < warm.max_steps:
        bar.update(job, completed=sft.step + 1, loss=sft.train_step())
        if sft.step % warm.eval_every and sft.step < warm.max_steps:
            continue
        accuracy = _probe(sft, bar, job, history)
        if _in_band(accuracy, band):
            return {"stopped": "in_band", "probe_history": history}
        if accuracy > high:
            # jumped past the band since the last evaluation: replay those (deterministic) steps, evaluating each
            jumped_at = sft.step
            sft.restore(last)
            while sft.step < jumped_at:
                bar.update(job, completed=sft.step + 1, loss=sft.train_step())
                accuracy = _probe(sft, bar, job, history)
                if _in_band(accuracy, band):
                    return {"stopped": "in_band_after_rollback", "probe_history": history}
                if accuracy > high:
                    break
            raise WarmStartError(
                f"warm start: probe accuracy jumped past target_band [{low:.0%}, {high:.0%}] at step {sft.step} "
                f"({history[-2][1]:.1%} -> {accuracy:.1%} in one step); widen model.warm_start.target_band")
        last = sft.snapshot()
    best = max(history, key=lambda row: row[1])
    raise WarmStartError(
        f"warm start: probe accuracy never reached target_band [{low:.0%}, {high:.0%}] within "
        f"model.warm_start.max_steps={warm.max_steps} (best {best[1]:.1%} at step {int(best[0])}); raise max_steps "
        "or lr, or lower the band")


def build_base_model(config: ModelConfig, tasks: TaskSet, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Build, warm-start, evaluate and save the tiny base model into `out_dir`; return the warmstart info.
    Raises WarmStartError, saving nothing, when the warm start cannot land in its target band."""
    start_s = time.perf_counter()
    warm = config.warm_start
    for name in warm.tasks:
        tasks[name]  # an unknown name fails before anything is built
    tokenizer = load_tokenizer(Path(config.tokenizer).expanduser()) if config.tokenizer else build_char_tokenizer()
    torch.manual_seed(warm.seed)
    model = CausalLM(model_args(config, tokenizer))
    init_weights(model)
    if warm.init_from is not None:
        first = ensure_base_model(config.model_copy(update={"warm_start": warm.init_from}), tasks, progress=progress)
        shards = sorted(first.glob("*.safetensors"))
        load_state(model, {name: tensor for shard in shards for name, tensor in load_file(str(shard)).items()})
    model.train()
    sft = _SupervisedPass(model, tokenizer, tasks, warm, PromptFormat.of(config, tokenizer))
    with _progress(progress) as bar:
        job = bar.add_task("warm start", total=warm.max_steps, loss=float("nan"), probe="-")
        outcome = _train_to_band(sft, bar, job)
    train_s = time.perf_counter() - start_s
    accuracy = sft.probe_accuracy_by_task()
    out_dir = Path(out_dir)
    save_pretrained(model, tokenizer, out_dir)
    info = {
        "steps": sft.step,
        "max_steps": warm.max_steps,
        "target_band": list(warm.target_band) if warm.target_band is not None else None,
        **outcome,
        "seed": warm.seed,
        "batch_size": warm.batch_size,
        "lr": warm.lr,
        "tasks": warm.tasks,
        "probe_problems": warm.probe_problems,
        "accuracy": accuracy,  # on the probe sets: RL's held-out sets play no part in building the base
        "loss": _loss_summary(sft.losses),
        "train_s": round(train_s, 2),
        "wall_s": round(time.perf_counter() - start_s, 2),
        "model_hash": config_hash(config, tasks),
    }
    (out_dir / WARMSTART_FILE).write_text(json.dumps(info, indent=2))
    return info


def config_hash(config: ModelConfig, tasks: Mapping[str, Task]) -> str:
    """sha256 of the build recipe and the model config JSON, without the fields that do not change the tiny model's
    weights (`path`, `cache_dir`, `init`, `init_seed`); the warm start's band, cap and probe are part of it, and so
    are the bytes of `model.tokenizer`'s files and of the warm start's datasets, not where they live, and the
    definitions of its gymnasium and reasoning-gym tasks."""
    tree = config.model_dump(mode="json", exclude={"path", "cache_dir", "init", "init_seed", "tokenizer"})
    warm = tree["warm_start"]
    while warm is not None:  # uniform draws: the key a base had before task_weights existed
        if not warm["task_weights"]:
            del warm["task_weights"]
        warm = warm["init_from"]
    tree["recipe"] = RECIPE_VERSION
    if config.tokenizer is not None:
        tree["tokenizer"] = _hash_files(hashlib.sha256(), Path(config.tokenizer).expanduser(),
                                        ("tokenizer.json", *TOKENIZER_FILES))
    datasets = {name: task.fingerprint() for name in config.warm_start.tasks
                if isinstance(task := tasks[name], DatasetTask | AgentTask)}
    if datasets:
        tree["datasets"] = datasets
    environments = {name: task.fingerprint() for name in config.warm_start.tasks
                    if isinstance(task := tasks[name], GymTask | ReasoningGymTask)}
    if environments:  # a config entry's options (a map size, a dataset's difficulty) change what is warm-started on
        tree["environments"] = environments
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def cached_model_dir(config: ModelConfig, tasks: Mapping[str, Task]) -> Path:
    if config.init == "random":
        return Path(config.cache_dir).expanduser() / f"random-{random_init_hash(config)}"
    return Path(config.cache_dir).expanduser() / f"base-{config_hash(config, tasks)}"


def ensure_base_model(config: ModelConfig, tasks: TaskSet, progress: bool = True) -> Path:
    """The model dir: `config.path` if it is a checkpoint (must hold config.json), else the cached tiny model
    (warm-started on `tasks`, scored by their rewards) or random init of `config.path`'s architecture, built once."""
    if config.path is not None and config.init != "random":
        path = Path(config.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path} is not an HF-format model dir (no config.json there)")
        return path
    final = cached_model_dir(config, tasks)
    marker = RANDOM_INIT_FILE if config.init == "random" else WARMSTART_FILE
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        if config.init == "random":
            build_random_model(config, tmp)
        else:
            build_base_model(config, tasks, tmp, progress=progress)
        os.rename(tmp, final)
    except OSError:
        # another process published the same model first: its copy is identical, keep it
        if not (final / marker).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def random_init_hash(config: ModelConfig) -> str:
    """sha256 of what a random init reads: config.json, the tokenizer files and generation_config.json as bytes,
    and the seed; not where they live."""
    digest = hashlib.sha256(f"random-init {RANDOM_INIT_VERSION} seed {config.init_seed}".encode())
    return _hash_files(digest, Path(config.path or "").expanduser(),
                       ("config.json", "generation_config.json", "tokenizer.json", *TOKENIZER_FILES))[:16]


def _hash_files(digest: Any, directory: Path, names: tuple[str, ...]) -> str:
    """`digest` updated with each file of `names` in `directory` that exists, by name and bytes; its hex digest."""
    for name in names:
        if (directory / name).is_file():
            digest.update(name.encode() + b"\0" + (directory / name).read_bytes())
    return digest.hexdigest()


def build_random_model(config: ModelConfig, out_dir: Path) -> dict[str, Any]:
    """`model.init: random`: the architecture `config.path`'s config.json describes (every key checked as a
    checkpoint's is), HF-style random weights from `init_seed`, and the tokenizer files beside it."""
    source = Path(config.path or "").expanduser()
    config_path = source / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model.init: random needs config.json in model.path {source}")
    start = time.perf_counter()
    try:
        args = ModelArgs.from_hf(json.loads(config_path.read_text()))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{config_path}: {exc}") from None
    tokenizer = load_tokenizer(source)
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens, the embedding only "
                         f"{args.vocab_size} rows")
    torch.manual_seed(config.init_seed)
    model = CausalLM(args)
    init_weights(model)
    save_pretrained(model, tokenizer, out_dir)
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out_dir / "generation_config.json")
    info = {"init": "random", "source": str(source.resolve()), "seed": config.init_seed,
            "parameters": sum(p.numel() for p in model.parameters()), "wall_s": round(time.perf_counter() - start, 2)}
    (out_dir / RANDOM_INIT_FILE).write_text(json.dumps(info, indent=2))
    return info


def main(config: ModelConfig, tasks: TaskSet, force: bool = False) -> None:
    """`jetroll init-model`: build (or reuse) the base model and print where it is and how good it is."""
    if force and (config.path is None or config.init == "random"):
        shutil.rmtree(cached_model_dir(config, tasks), ignore_errors=True)
    path = ensure_base_model(config, tasks)
    info_path = path / WARMSTART_FILE
    print(f"base model: {path}")
    if (path / RANDOM_INIT_FILE).is_file():
        info = json.loads((path / RANDOM_INIT_FILE).read_text())
        print(f"random init of {info['source']}/config.json: {info['parameters']:,} parameters, seed {info['seed']}, "
              f"{info['wall_s']:.0f} s")
    elif info_path.is_file():
        info = json.loads(info_path.read_text())
        accuracy = ", ".join(f"{name} {acc:.1%}" for name, acc in info["accuracy"].items())
        band = info["target_band"]
        outcome = (f"stopped in target_band [{band[0]:.0%}, {band[1]:.0%}]"
                   + (" after a rollback" if info["stopped"] == "in_band_after_rollback" else "")
                   if band is not None else "fixed step count")
        print(f"warm start: {info['steps']} of at most {info['max_steps']} steps ({outcome}), seed {info['seed']}, "
              f"{info['wall_s']:.0f} s; probe greedy accuracy: {accuracy}")
    else:
        print("no warmstart.json: a user-supplied model")
