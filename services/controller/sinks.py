"""Metric sinks beside metrics.jsonl: TensorBoard event files and Weights & Biases runs (`metrics.sinks`).

metrics.jsonl keeps the names the controller and the benches read. The sinks get the same values under one
scheme, after verl's: `actor/` the trainer's loss and update statistics, `rollout/` throughput and staleness,
`reward/`, `train/` the training batch's accuracy and task mix, `precision/` the rollout-trainer mismatch,
`timing/` where the wall time goes, `eval/` held-out accuracy. `scheme_name` maps one to the other.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Protocol

from jetroll.shared.config.job import JobConfig, config_tree
from jetroll.shared.errors import ConfigError

RENAMES = {
    "time_s": "timing/elapsed_s", "step_time_s": "timing/step_s", "stage_s": "timing/stage_s",
    "commit_wait_s": "timing/commit_wait_s", "trainer_wait_s": "timing/trainer_wait_s",
    "stale_wait_s": "timing/stale_wait_s", "trainer_idle_frac": "timing/trainer_idle_frac",
    "rollout_idle_frac": "timing/rollout_idle_frac",
    "rollout_tokens_per_s": "rollout/tokens_per_s", "rollout_busy_slot_s": "rollout/busy_slot_s",
    "rollout_slot_s": "rollout/slot_s", "token_lag_mean": "rollout/token_lag_mean",
    "mixed_version_frac": "rollout/mixed_version_frac", "mixed_version_token_frac": "rollout/mixed_version_token_frac",
    "reward_mean": "reward/mean", "reward_timeouts": "reward/timeouts", "reward_errors": "reward/errors",
    "precision_mismatch": "precision/mismatch", "mismatch_abs_sum": "precision/mismatch_abs_sum",
    "mismatch_abs_max": "precision/mismatch_abs_max", "mismatch_tokens": "precision/mismatch_tokens",
    "mismatch_coverage": "precision/mismatch_coverage", "mismatch_sample_s": "precision/mismatch_sample_s",
    "mismatch_wait_s": "timing/mismatch_wait_s",
}
TAG_UNSAFE = re.compile(r"[^\w./-]")
PREFIXES = (("accuracy/", "train/accuracy/"), ("groups/", "train/groups/"), ("reward/", "reward/"),
            ("pool/", "rollout/pool/"), ("lag_", "rollout/lag_"), ("mismatch/", "precision/mismatch/"),
            ("mismatch_gate/", "precision/mismatch_gate/"))


def scheme_name(key: str) -> str:
    """The sinks' name of a metrics.jsonl column; the trainer's loss and update statistics go under actor/. Only
    letters, digits and `_ . / -` stay (TensorBoard rewrites any other character in a tag): `@` becomes `_`."""
    if key in RENAMES:
        return RENAMES[key]
    for prefix, section in PREFIXES:
        if key.startswith(prefix):
            return TAG_UNSAFE.sub("_", section + key.removeprefix(prefix))
    return TAG_UNSAFE.sub("_", f"actor/{key}")


class Sink(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, config: JobConfig, run_dir: Path) -> None:
        import wandb

        # one run per job: a restarted controller resumes it
        self.run = wandb.init(project=config.metrics.wandb_project, mode=config.metrics.wandb_mode, dir=str(run_dir),
                              id=config.job_id, name=config.job_id, resume="allow",
                              config=config_tree(config), settings=wandb.Settings(silent=True))
        self.last_step = 0

    def write(self, step: int, values: dict[str, float]) -> None:
        # W&B drops a step below one it has seen: an evaluation that lands after later rows goes on the newest step
        self.last_step = max(step, self.last_step)
        self.run.log(values, step=self.last_step)

    def close(self) -> None:
        self.run.finish()


class MetricSinks:
    """The configured sinks; each step's row and each evaluation go to all of them under the scheme's names."""

    def __init__(self, config: JobConfig, run_dir: Path) -> None:
        self.sinks: list[Sink] = []
        for name in config.metrics.sinks:
            try:
                self.sinks.append(TensorBoardSink(run_dir) if name == "tensorboard" else WandbSink(config, run_dir))
            except ImportError as exc:
                package = "tensorboardX" if name == "tensorboard" else "wandb"
                raise ConfigError(f"metrics.sinks has {name}, which needs {package}: pip install "
                                  f"'jetroll[metrics]' ({exc})") from None

    def write_row(self, row: dict[str, float]) -> None:
        values = {scheme_name(k): float(v) for k, v in row.items() if k != "step" and not _is_nan(v)}
        for sink in self.sinks:
            sink.write(int(row["step"]), values)

    def write_eval(self, version: int, accuracy: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(version, {"eval/version": float(version),
                                 **{f"eval/accuracy/{task}": value for task, value in accuracy.items()}})

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _is_nan(value: float) -> bool:
    return isinstance(value, float) and math.isnan(value)
