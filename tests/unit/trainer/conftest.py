"""The trainer's tests: the tiny model their Trainer loads."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from trainer_harness import TINY

from jetroll.shared.model.checkpoint import save_pretrained
from jetroll.shared.model.init import init_weights, model_args
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="jetroll-step-model-") as tmp:
        tokenizer = build_char_tokenizer()
        torch.manual_seed(0)
        model = CausalLM(model_args(TINY, tokenizer))
        init_weights(model)
        save_pretrained(model, tokenizer, tmp)
        yield Path(tmp)
