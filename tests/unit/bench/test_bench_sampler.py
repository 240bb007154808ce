"""The peers bench's CPU accounting: each process named by its service for the whole run (a forked child before its
exec and an exiting one, whose command line is gone, included), and a window that ends before a service exits."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetroll.bench import peers
from jetroll.bench.peers import TreeSampler, cpu_window
from jetroll.bench.processes import Process

LAUNCHER = [b"python", b"-m", b"jetroll.services.cli", b"run", b"job.yaml"]
TRAINER = [b"python", b"-m", b"jetroll.services.cli", b"trainer", b"--config", b"c.json"]
REWARD = [b"python", b"-m", b"jetroll.services.cli", b"reward", b"--config", b"c.json"]


def test_each_process_keeps_its_service_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = TreeSampler(1, tmp_path / "progress", tmp_path)
    sampler.stop()
    tables = [  # the trainer forked (its parent's command line) then exec'd, then exiting; a reward pool worker
        {1: Process(1, 0, "S", LAUNCHER, 1.0), 2: Process(2, 1, "R", LAUNCHER, 0.0)},
        {1: Process(1, 0, "S", LAUNCHER, 1.0), 2: Process(2, 1, "R", TRAINER, 5.0), 3: Process(3, 1, "S", REWARD, 2.0),
         4: Process(4, 3, "S", REWARD, 1.5)},
        {1: Process(1, 0, "S", LAUNCHER, 1.0), 2: Process(2, 1, "Z", [b""], 9.0), 3: Process(3, 1, "S", REWARD, 3.0),
         4: Process(4, 3, "S", REWARD, 2.5)},
    ]
    seen = []
    for table in tables:
        monkeypatch.setattr(peers, "processes", lambda table=table: table)
        seen.append(sampler.sample()["cpu_s"])
    assert seen == [{"launcher": 1.0, "launcher/child": 0.0},
                    {"launcher": 1.0, "trainer": 5.0, "reward": 2.0, "reward/child": 1.5},
                    {"launcher": 1.0, "trainer": 9.0, "reward": 3.0, "reward/child": 2.5}]


def test_the_cpu_window_ends_while_every_service_still_runs() -> None:
    samples = [{"wall_s": 0.0, "lines": 1, "cpu_s": {"trainer": 1.0, "reward": 1.0}},
               {"wall_s": 10.0, "lines": 99, "cpu_s": {"trainer": 11.0, "reward": 3.0}},
               {"wall_s": 10.1, "lines": 100, "cpu_s": {"trainer": 11.1}}]  # the reward router has exited
    window = cpu_window(samples, first_line=1)
    assert window["core_s_per_step_by_process"] == pytest.approx({"trainer": 10.0 / 98, "reward": 2.0 / 98})
    samples[-1]["cpu_s"]["reward"] = 3.01  # every service still there: the first sample at the last step
    assert cpu_window(samples, first_line=1)["core_s_per_step_by_process"]["trainer"] == pytest.approx(10.1 / 99)
