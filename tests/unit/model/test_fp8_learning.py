"""Both FP8 backward flavours learn: supervised arithmetic from scratch through the FP8 linears (forward Q1x128(X) .
Q128x128(W), backward `fp8` or `bf16`), against the same run in fp32."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from jetroll.shared.config.model import ModelConfig
from jetroll.shared.model.init import init_weights, model_args
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.numerics import Numerics
from jetroll.shared.sft import IGNORE_INDEX, sft_batch
from jetroll.shared.tasks.registry import TaskSet
from jetroll.shared.warm_start import sft_lr

STEPS, BATCH, LR = 200, 32, 3e-3
TINY = ModelConfig(num_layers=1, intermediate_size=256)


def train(precision: Numerics) -> tuple[float, float]:
    """Held-out next-token loss on arithmetic answers before and after STEPS of SFT (same init, same data)."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(model_args(TINY, tokenizer), precision)
    init_weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98))
    heldout = sft_batch(tokenizer, TaskSet(), ["arithmetic"], 256, random.Random(12345))

    def heldout_loss() -> float:
        with torch.no_grad():
            logits = model(heldout[0])
        return F.cross_entropy(logits.flatten(0, 1), heldout[1].flatten(), ignore_index=IGNORE_INDEX).item()

    before = heldout_loss()
    rng = random.Random(0)
    for step in range(STEPS):
        inputs, targets = sft_batch(tokenizer, TaskSet(), ["arithmetic"], BATCH, rng)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        for group in optimizer.param_groups:
            group["lr"] = sft_lr(step, STEPS, LR)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return before, heldout_loss()


@pytest.fixture(scope="module")
def fp32_loss() -> tuple[float, float]:
    return train(Numerics(mode="fp32"))


@pytest.mark.slow
@pytest.mark.parametrize("backward", ["fp8", "bf16"])
def test_fp8_training_learns_like_fp32(backward: str, fp32_loss: tuple[float, float]) -> None:
    before, after = train(Numerics(mode="fp8_unified", backward=backward))
    print(f"held-out loss: fp32 {fp32_loss[0]:.3f} -> {fp32_loss[1]:.3f}; fp8 with {backward} backward "
          f"{before:.3f} -> {after:.3f}")
    assert after < 0.5 * before
    assert after < 1.1 * fp32_loss[1]
