"""The console view off a terminal: a plain line for the first and the last step and one every
PLAIN_LINE_EVERY_S between, not one per step (`make demo > log` wrote 3,000 lines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetroll.services.controller import progress
from jetroll.services.controller.progress import MetricsBook, ProgressView


def test_off_a_terminal_a_line_comes_every_few_seconds_and_at_the_first_and_last_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    view = ProgressView(MetricsBook(tmp_path), max_steps=100, tasks=["arithmetic"])
    assert not view.is_live  # pytest captures stdout: not a terminal
    for step in range(1, 101):
        now[0] = step * 0.5  # two steps a second: a line every 20 steps
        view.update({"step": step, "rollout_tokens_per_s": 1.0, "reward/arithmetic": 0.5})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [f"step {s}/100" for s in (1, 21, 41, 61, 81, 100)]
    assert "arithmetic: reward 0.500" in lines[0]
