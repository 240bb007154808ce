"""Metrics aggregation, the live console view, metrics.jsonl and the final PNG plot."""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from jetroll.shared.protocol.events import MetricsEvent


class MetricsBook:
    """Collects Metrics events; one row per trainer step goes to metrics.jsonl when the step is done."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, float]] = []
        self.latest: dict[str, float] = {}  # service/name -> last value (rollout throughput etc.)
        self.totals: dict[str, float] = defaultdict(float)
        self.evals: list[dict[str, float]] = []
        self.started = time.time()
        if self.path.exists():  # a restarted controller (or a resumed job) goes on from what is written
            for line in self.path.read_text().splitlines():
                self._count(json.loads(line))

    def _count(self, row: dict[str, float]) -> None:
        for key, value in row.items():
            if key in ("mismatch_abs_sum", "mismatch_tokens", "num_policy_tokens") or key.startswith("groups/"):
                self.totals[key] += value
        self.rows.append(row)

    def add(self, event: MetricsEvent) -> dict[str, float] | None:
        """A trainer's event is its step's row; another service's values are kept as its latest."""
        if event.service != "trainer":
            self.latest |= {f"{event.service}/{name}": value for name, value in event.values.items()}
            return None
        if any(r["step"] == event.step for r in self.rows):  # already written before a restart
            return None
        row = {"step": event.step, "time_s": event.time - self.started, **event.values,
               "rollout_tokens_per_s": self.rollout_tokens_per_s(), **self._service_columns()}
        self._count(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    def _service_columns(self) -> dict[str, float]:
        """What other services report, per step: rollout slot-seconds busy and available (cumulative over workers)
        with the idle fraction since the last row; the reward router's timed-out and failed attempts (cumulative);
        per pool, its throughput and its environments' failures (trajectories by final status, calls by status with
        retried ones), episodes and mean set-up share (a reset's time over its episode's, by how episodes ended)."""
        def total(suffix: str) -> float:
            return sum(v for k, v in self.latest.items() if k.endswith(suffix))

        busy, slots = total("/busy_slot_s"), total("/slot_s")
        last = self.rows[-1] if self.rows else {}
        new_slots = slots - last.get("rollout_slot_s", 0.0)
        new_busy = busy - last.get("rollout_busy_slot_s", 0.0)
        idle = min(1.0, max(0.0, 1.0 - new_busy / new_slots)) if new_slots > 0 else float("nan")
        per_pool = {}
        for pool in sorted({key.split("/pool/", 1)[1].split("/", 1)[0] for key in self.latest if "/pool/" in key}):
            names = {key.split(f"/pool/{pool}/", 1)[1] for key in self.latest if f"/pool/{pool}/" in key}
            for name in sorted(n for n in names if n in ("tokens_per_s", "num_trajectories")
                               or n.startswith(("env_fail/", "env_failed_calls/", "env_episodes/"))):
                per_pool[f"pool/{pool}/{name}"] = total(f"/pool/{pool}/{name}")
            for name in sorted(n for n in names if n.startswith("env_setup_share_sum/")):
                ended = name.split("/", 1)[1]
                episodes = total(f"/pool/{pool}/env_episodes/{ended}")
                per_pool[f"pool/{pool}/env_setup_share/{ended}"] = total(f"/pool/{pool}/{name}") / max(episodes, 1)
        return {"rollout_busy_slot_s": busy, "rollout_slot_s": slots, "rollout_idle_frac": idle,
                "reward_timeouts": total("/reward/timeouts"), "reward_errors": total("/reward/errors"), **per_pool}

    def rollout_tokens_per_s(self) -> float:
        return sum(v for k, v in self.latest.items() if k.endswith("/tokens_per_s"))

    def mismatch(self) -> tuple[float, float]:
        """Mean |logp_trainer - mu| over same-version tokens, and that coverage fraction."""
        tokens = self.totals["mismatch_tokens"]
        mean = self.totals["mismatch_abs_sum"] / tokens if tokens else float("nan")
        return mean, tokens / max(self.totals["num_policy_tokens"], 1.0)


def _measured(row: dict[str, float], key: str, spec: str) -> str:
    """A metric as the console shows it: `n/a` for a step that measured none (no token to measure), never nan."""
    value = row.get(key, math.nan)
    return "n/a" if math.isnan(value) else format(value, spec)


# off a terminal (a log file, CI) a plain line this often at most, besides the first and the last step's
PLAIN_LINE_EVERY_S = 10.0


class ProgressView:
    """A rich live table on a terminal; elsewhere (a log file, CI) a plain line for the first step, the last, and a
    step at least PLAIN_LINE_EVERY_S after the line before: a 3000-step job writes minutes, not steps."""

    def __init__(self, book: MetricsBook, max_steps: int, tasks: list[str]) -> None:
        self.book, self.max_steps, self.tasks = book, max_steps, tasks
        self.line_at = -math.inf
        self.console = Console()
        self.is_live = sys.stdout.isatty()
        self.live = Live(console=self.console, refresh_per_second=2) if self.is_live else None
        self.stream_lags: dict[str, int] = {}
        self.version = 0
        self.num_dropped = 0

    def __enter__(self) -> ProgressView:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, row: dict[str, float] | None = None) -> None:
        if self.live:
            self.live.update(self._table())
        elif row is not None and self._is_line_due(int(row["step"])):
            parts = [f"step {int(row['step'])}/{self.max_steps}"]
            for task in self.tasks:
                parts.append(f"{task}: reward {row.get(f'reward/{task}', float('nan')):.3f} "
                             f"acc {row.get(f'accuracy/{task}', float('nan')):.3f}")
            parts.append(f"tok/s {row['rollout_tokens_per_s']:.0f} lag {row.get('lag_mean', 0):.2f} "
                         f"mismatch {_measured(row, 'precision_mismatch', '.2e')} "
                         f"k3 {_measured(row, 'mismatch/k3', '.1e')} of {_measured(row, 'mismatch_coverage', '.1%')}")
            print(" | ".join(parts), flush=True)

    def _is_line_due(self, step: int) -> bool:
        now = time.monotonic()
        if self.line_at == -math.inf or step >= self.max_steps or now - self.line_at >= PLAIN_LINE_EVERY_S:
            self.line_at = now
            return True
        return False

    def _table(self) -> Table:
        row = self.book.rows[-1] if self.book.rows else {}
        table = Table(title=f"jetroll  step {int(row.get('step', 0))}/{self.max_steps}  version {self.version}")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for task in self.tasks:
            table.add_row(f"{task} reward", f"{row.get(f'reward/{task}', float('nan')):.3f}")
            table.add_row(f"{task} accuracy (train)", f"{row.get(f'accuracy/{task}', float('nan')):.3f}")
        for ev in self.book.evals[-1:]:
            for task in self.tasks:
                table.add_row(f"{task} held-out accuracy (v{int(ev['version'])})", f"{ev.get(task, float('nan')):.3f}")
        table.add_row("rollout tokens/s", f"{self.book.rollout_tokens_per_s():.0f}")
        table.add_row("lag mean / max", f"{row.get('lag_mean', 0):.2f} / {row.get('lag_max', 0):.0f}")
        table.add_row("precision mismatch |dlogp| mean / max",
                      f"{_measured(row, 'precision_mismatch', '.2e')} / {_measured(row, 'mismatch/abs_max', '.2e')}")
        table.add_row("mismatch k3 / seq |sum dlogp|", f"{_measured(row, 'mismatch/k3', '.2e')} / "
                      f"{_measured(row, 'mismatch/seq_delta_abs_mean', '.2e')}")
        table.add_row("mismatch TIS clip frac", _measured(row, "mismatch/tis_clip_frac", ".3f"))
        table.add_row("mismatch coverage (of policy tokens)", _measured(row, "mismatch_coverage", ".1%"))
        table.add_row("dropped groups", str(self.num_dropped))
        for stream, lag in self.stream_lags.items():
            table.add_row(f"lag {stream}", str(lag))
        return table


def plot_curves(book: MetricsBook, tasks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in book.rows]
    for task in tasks:
        for ax, name in ((ax_reward, "reward"), (ax_acc, "accuracy")):
            raw = [r.get(f"{name}/{task}", float("nan")) for r in book.rows]
            (line,) = ax.plot(steps, raw, alpha=0.25, linewidth=0.8)
            ax.plot(steps, smoothed(raw), color=line.get_color(),
                    label=task if name == "reward" else f"{task} (train batch)")
        ax_acc.plot([e["version"] for e in book.evals], [e.get(task, float("nan")) for e in book.evals], "o-",
                    label=f"{task} (held-out, greedy)")
    ax_reward.set(title="reward", xlabel="step")
    ax_acc.set(title="accuracy", xlabel="step", ylim=(0, 1))
    for ax in (ax_reward, ax_acc):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def smoothed(values: list[float]) -> list[float]:
    """A trailing mean over about 2% of the series (at least 1 step), NaNs skipped: the curve drawn over the raw
    values."""
    window = max(1, len(values) // 50)
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i + 1 - window):i + 1] if not math.isnan(v)]
        out.append(sum(recent) / len(recent) if recent else float("nan"))
    return out
