"""`precision.mismatch.gate`: the thresholds on k3 and mean |delta logp|, and k3's growth, each with its action."""

from __future__ import annotations

import logging

import pytest

from jetroll.services.trainer.mismatch import MismatchGateKeeper
from jetroll.shared.config.precision import MismatchGates


def keeper(**gates: dict) -> MismatchGateKeeper:
    off = {"k3": {"above": None}, "abs_mean": {"above": None}, "growth": {"above": None}}
    return MismatchGateKeeper(MismatchGates.model_validate(off | gates))


def measured(k3: float, abs_mean: float = 0.0) -> dict[str, float]:
    return {"mismatch/k3": k3, "mismatch/abs_mean": abs_mean}


def test_a_threshold_gate_fails_with_one_line_naming_the_figure_its_value_and_its_threshold() -> None:
    gates = keeper(k3={"above": 5e-3}, abs_mean={"above": 0.05, "action": "fail"})
    assert gates.check(1, measured(4e-3, 0.01)) == ({}, None)
    assert gates.check(2, measured(6e-3, 0.01)) == (
        {"mismatch/growth": pytest.approx(1.5), "mismatch_gate/k3": 1.0},
        "mismatch k3 0.006 at step 2 is above precision.mismatch.gate.k3.above = 0.005")
    assert gates.check(3, measured(1e-3, 0.2))[1] == (
        "mismatch abs_mean 0.2 at step 3 is above precision.mismatch.gate.abs_mean.above = 0.05")


def test_a_warn_gate_logs_and_counts_beside_a_failing_one(caplog: pytest.LogCaptureFixture) -> None:
    gates = keeper(k3={"above": 5e-3}, abs_mean={"above": 0.05, "action": "warn"})
    with caplog.at_level(logging.WARNING, logger="jetroll.trainer"):
        stats, failed = gates.check(7, measured(6e-3, 0.2))
    assert stats == {"mismatch_gate/k3": 1.0, "mismatch_gate/abs_mean": 1.0}  # each tripped gate, whatever its action
    assert failed is not None and failed.startswith("mismatch k3 0.006")
    assert "mismatch abs_mean 0.2 at step 7" in caplog.text and "mismatch k3" not in caplog.text


def test_growth_trips_at_the_second_measured_step_and_later_over_its_window() -> None:
    # the misaligned refit: aligned at step 1, 30x at step 2
    early = keeper(growth={"above": 10.0, "window": 3, "floor": 1e-6, "action": "fail"})
    assert early.check(1, measured(1e-5)) == ({}, None)
    stats, line = early.check(2, measured(3e-4))
    assert stats == {"mismatch/growth": pytest.approx(30.0), "mismatch_gate/growth": 1.0}
    assert line == ("mismatch k3 grew 30x at step 2 (mean 0.0003 over the latest 1 measured steps, 1e-05 over the "
                    "first 1), above precision.mismatch.gate.growth.above = 10")
    # a slow drift (prime-rl's 0.002 -> 0.035): the first 3 steps are the baseline, the latest 3 are compared
    drift = keeper(growth={"above": 10.0, "window": 3, "floor": 1e-6, "action": "fail"})
    values = [2e-3 * 1.2**i for i in range(17)]
    lines = [drift.check(step, measured(k3))[1] for step, k3 in enumerate(values, 1)]
    first = next(i for i, line in enumerate(lines, 1) if line is not None)
    assert 14 <= first <= 17, lines
    # no step measured: nothing changes
    assert drift.check(18, {}) == ({}, None) and len(drift.k3s) == 17


def test_growth_of_rounding_noise_never_trips() -> None:
    gates = keeper(growth={"above": 10.0, "window": 2, "floor": 1e-6, "action": "fail"})
    for step, k3 in enumerate([0.0, 1e-10, 3e-9, 5e-8, 4e-7, 0.0, 9e-7], 1):
        stats, failed = gates.check(step, measured(k3))
        assert failed is None and not [name for name in stats if name.startswith("mismatch_gate/")]
    assert stats == {"mismatch/growth": pytest.approx(0.45)}  # the latest two, (0 + 9e-7) / 2, over the floor
