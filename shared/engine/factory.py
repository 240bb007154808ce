"""Where the config's engine names become engines: a rollout pool's (jetroll's, vLLM or the timing model) and the
trainer's step (the actor's own, or the timing model's sleep). The services get them from here and never ask which."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetroll.shared.config.precision import PrecisionConfig
from jetroll.shared.config.rollout import PoolConfig, RolloutConfig
from jetroll.shared.config.trainer import TrainerConfig
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.interface import RolloutEngine
from jetroll.shared.engine.timing import TimingEngine
from jetroll.shared.engine.vllm import VllmEngine
from jetroll.shared.model.checkpoint import load_pretrained, read_args, torch_device
from jetroll.shared.model.tokenizer import Tokenizer, load_tokenizer

# the trainer's step: (groups, version) -> (its stats, the call that measures its precision mismatch)
StepFn = Callable[[list[Any], int], tuple[dict[str, float], Callable[[], dict[str, float]]]]


@dataclass(frozen=True, slots=True)
class BuiltEngine:
    engine: RolloutEngine
    tokenizer: Tokenizer
    vocab_rows: int  # the embedding's rows: every token id an event carries is below it


def build_engine(rollout: RolloutConfig, precision: PrecisionConfig, seed: int, pool: PoolConfig,
                 directory: Path) -> BuiltEngine:
    """`pool`'s engine on the weights in `directory` (a published version), decoding in `precision`."""
    name = rollout.engine_of(pool)
    max_batch = pool.max_batch or rollout.max_batch
    if name == "timing":
        tokenizer = load_tokenizer(directory)
        engine: RolloutEngine = TimingEngine(pool.timing or rollout.timing, tokenizer.eos_id, tokenizer.vocab_size,
                                             max_batch, rollout.max_seq_len)
        return BuiltEngine(engine, tokenizer, tokenizer.vocab_size)
    if name == "vllm":
        args, _ = read_args(directory)  # what jetroll's loader refuses, vLLM never runs
        tokenizer = load_tokenizer(directory)
        if tokenizer.vocab_size > args.vocab_size:
            raise ValueError(f"{directory}: the tokenizer has {tokenizer.vocab_size} tokens, the embedding only "
                             f"{args.vocab_size} rows")
        engine = VllmEngine(directory, args, tokenizer.vocab_size, precision.mode, max_batch,
                            rollout.max_seq_len, seed=seed, compile=rollout.compile, device=rollout.device,
                            threads=rollout.threads)
        return BuiltEngine(engine, tokenizer, args.vocab_size)
    model, tokenizer = load_pretrained(directory, precision.numerics(),
                                       torch_device(rollout.device, "rollout.device"))
    model.share_inference_masters()  # this model never trains: hold its block linears once
    engine = Engine(model, tokenizer.eos_id, max_batch, rollout.max_seq_len, seed=seed,
                    compile=rollout.compile)
    return BuiltEngine(engine, tokenizer, model.args.vocab_size)


def modelled_step(trainer: TrainerConfig, publish_s: Callable[[], float]) -> StepFn | None:
    """The trainer's step when `trainer.engine` models it (timing: a sleep, the weights unchanged), else None: the
    actor steps. The modelled time covers the step and its weight publication, which stays real (`publish_s()`)."""
    if trainer.engine != "timing":
        return None

    def sleep_for_a_step(groups: list[Any], version: int) -> tuple[dict[str, float], Callable[[], dict[str, float]]]:
        time.sleep(max(0.0, trainer.timing_step_s - publish_s()))
        return {}, dict

    return sleep_for_a_step
