"""The learning-rate schedule shared by the SFT warm start and the RL trainer."""

from __future__ import annotations

import math

import pytest

from jetroll.shared.config.job import load_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.rl.schedule import cosine_lr
from jetroll.shared.warm_start import sft_lr


def test_cosine_without_warmup_starts_at_the_peak_and_decays_to_the_floor() -> None:
    values = [cosine_lr(step, 100, 2e-4, warmup_steps=0, final_ratio=0.1) for step in range(101)]
    assert values[0] == pytest.approx(2e-4)
    assert values[50] == pytest.approx(2e-4 * (0.1 + 0.9 * 0.5))
    assert values[100] == pytest.approx(2e-5)
    assert all(a > b for a, b in zip(values, values[1:], strict=False))
    assert cosine_lr(100, 100, 1e-3, warmup_steps=0, final_ratio=0.0) == pytest.approx(0.0, abs=1e-12)


def test_warmup_is_linear_then_cosine() -> None:
    assert [cosine_lr(s, 40, 1.0, warmup_steps=4, final_ratio=0.0) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine_lr(4, 40, 1.0, warmup_steps=4, final_ratio=0.0) == 1.0
    assert cosine_lr(22, 40, 1.0, warmup_steps=4, final_ratio=0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))


def test_hold_keeps_the_peak_then_decays_over_the_rest() -> None:
    values = [cosine_lr(s, 100, 1.0, warmup_steps=0, final_ratio=0.0, hold_steps=60) for s in range(101)]
    assert values[:61] == [1.0] * 61
    assert values[80] == pytest.approx(0.5)
    assert values[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(values[60:], values[61:], strict=False))


def test_sft_schedule_is_the_warm_start_one() -> None:
    """5% linear warmup, then cosine to 10% of the peak, over the warm start's max_steps."""
    assert sft_lr(0, 5250, 2e-3) == 2e-3 / 262
    assert sft_lr(261, 5250, 2e-3) == 2e-3
    assert sft_lr(262, 5250, 2e-3) == 2e-3 * (0.1 + 0.45 * 2)
    assert sft_lr(5249, 5250, 2e-3) == pytest.approx(2e-4, rel=1e-4)


def test_trainer_schedule_is_validated() -> None:
    with pytest.raises(ConfigError, match="trainer.lr_schedule"):
        load_config(None, ["trainer.lr_schedule=linear"])
    with pytest.raises(ConfigError, match="trainer.lr_final_ratio"):
        load_config(None, ["trainer.lr_final_ratio=2"])
    with pytest.raises(ConfigError, match="trainer.lr_decay_frac"):
        load_config(None, ["trainer.lr_decay_frac=0"])
