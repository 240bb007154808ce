"""`trainer.device` and `rollout.device`: every tensor a service makes follows the model's device.

No GPU runs here, so the check is structural: torch's default device is set to `meta` while a rollout engine and a
trainer step run on the CPU. A tensor made without an explicit device would land on `meta`, where it has no data:
mixing it into the step raises, and reading it back fails. The results must equal those of the same run with the
default device left alone. A device the machine lacks fails the service with one line, and the job with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from trainer_harness import events_with_ratios, flat_parameters, groups_of, make_trainer, step

from jetroll.services.trainer.trainer import Trainer
from jetroll.shared.config.model import ModelConfig
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.errors import JobFailedError
from jetroll.shared.model.checkpoint import torch_device
from jetroll.shared.model.init import init_weights, model_args
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.numerics import Numerics

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path and a missing CUDA device")]


@contextlib.contextmanager
def tensors_default_to_meta() -> Iterator[None]:
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def tiny_model(backend: str) -> tuple[CausalLM, int]:
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(model_args(ModelConfig(num_layers=2, intermediate_size=256), tokenizer),
                     Numerics(backend=backend))
    init_weights(model)
    return model, tokenizer.eos_id


def rollout(model: CausalLM, eos_id: int, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list[int]]]:
    """Prefill and decode, a weight swap mid-flight with its KV recompute, then decode to the end."""
    engine = Engine(model, eos_id, max_batch=8, max_len=40, seed=3)
    requests = [Request(f"r{i}", ids, max_new_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True)
                for i, ids in enumerate(prompts)]
    engine.add(requests)
    for _ in range(4):
        engine.step()
    state = {name: tensor + 0.01 for name, tensor in model.state_dict().items()}
    engine.swap_weights(state, version=1, recompute_kv=True)
    while engine.has_work:
        engine.step()
    return [(r.output_ids, r.logprobs, r.versions) for r in requests]


@pytest.mark.parametrize("backend", ["fast", "exact"])
def test_rollout_makes_every_tensor_on_its_models_device(backend: str, one_thread: None) -> None:
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
    expected = rollout(*tiny_model(backend), prompts)
    model, eos_id = tiny_model(backend)
    with tensors_default_to_meta():
        got = rollout(model, eos_id, prompts)
    assert got == expected
    assert {v for _, _, versions in got for v in versions} == {0, 1}


def test_a_trainer_step_makes_every_tensor_on_its_models_device(
    model_dir: Path, redis_url: str, tmp_path: Path, one_thread: None  # noqa: F811
) -> None:
    """The real `Trainer._step`, with a KL reference: batch assembly, the packed forward, the chunked head and its
    backward, the loss and AdamW; then a second step, whose tokens one version old the mismatch sampler scores with
    the kept weights of that version."""
    events = events_with_ratios(make_trainer(model_dir, tmp_path / "probe", redis_url))
    sections = {"trainer": {"group_size": 4, "kl_coef": 0.01}, "precision": {"mismatch": {"sample": 0.5}}}

    def two_steps(trainer: Trainer) -> list[dict[str, float]]:
        first = step(trainer, groups_of(events))
        trainer.version = 1
        # the sampler's own clock aside, every figure must be the same
        return [{k: v for k, v in stats.items() if k != "mismatch_sample_s"}
                for stats in (first, step(trainer, groups_of(events)))]

    host = make_trainer(model_dir, tmp_path / "host", redis_url, **sections)
    expected = two_steps(host)
    assert expected[1]["mismatch_tokens"] > 0
    trainer = make_trainer(model_dir, tmp_path / "meta", redis_url, **sections)
    with tensors_default_to_meta():
        stats = two_steps(trainer)
    assert stats == expected
    assert torch.equal(flat_parameters(trainer), flat_parameters(host))


@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_a_device_the_machine_lacks_fails_with_one_line(spec: str) -> None:
    with pytest.raises(JobFailedError, match=rf"^trainer.device is {spec}, but this torch .* sees no CUDA device$"):
        torch_device(spec, "trainer.device")
