"""The trainer's own config (`TrainerSections`): what it needs of the other sections is resolved at its entry, and
no other module of the trainer reads the job's config."""

from __future__ import annotations

import ast
from pathlib import Path

from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.config.job import validate_config

TRAINER = Path(__file__).resolve().parents[3] / "services" / "trainer"


def test_the_sections_resolve_budgets_bounds_and_pools_from_the_other_sections() -> None:
    config = validate_config({
        "tasks": [{"name": "arithmetic"}, {"name": "count32", "max_staleness": 3}],
        "staleness": {"mode": "async", "max_staleness": 1},
        "rollout": {"max_new_tokens": 12, "recompute_kv_on_swap": False,
                    "pools": [{"name": "fast"}, {"name": "drawn", "engine": "timing"}]},
        "trainer": {"task_quotas": True, "groups_per_step": 8},
    })
    tasks = config.build_tasks()
    sections = TrainerSections.of(config, tasks)
    assert tasks["arithmetic"].max_new_tokens < 12 < tasks["count32"].max_new_tokens  # one capped, one not
    assert sections.sample_budgets == {"arithmetic": tasks["arithmetic"].max_new_tokens, "count32": 12}
    assert sections.eta_hard == {"arithmetic": 2, "count32": 6} and sections.max_eta_hard == 6
    assert sections.in_flight_slack == {"arithmetic": 0, "count32": 4}
    assert sections.task_quotas == {"arithmetic": 4, "count32": 4}
    assert sections.pool_engines == {"fast": "jetroll", "drawn": "timing"}
    assert sections.pools_computing_mu == {"fast"} and sections.rollout_keeps_kv
    other = validate_config({"trainer": {"task_quotas": False}})
    other_sections = TrainerSections.of(other, other.build_tasks())
    assert other_sections.task_quotas is None and not other_sections.rollout_keeps_kv


def test_only_the_trainers_entry_reads_the_jobs_config() -> None:
    """`trainer.py` hands `TrainerSections` down; `sections.py` builds it. No other trainer module names `JobConfig`
    or another service's section."""
    readers = {}
    for path in sorted(TRAINER.glob("*.py")):
        if path.name in {"trainer.py", "sections.py"}:
            continue
        tree = ast.parse(path.read_text())
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        sections = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _is_config(node.value)}
        found = ({"JobConfig"} & names) | ({"rollout", "reward", "eval", "launch", "tasks"} & sections)
        if found:
            readers[path.name] = sorted(found)
    assert readers == {}, readers


def _is_config(node: ast.expr) -> bool:
    """`config` or `self.config`: what a trainer module calls its config."""
    return (isinstance(node, ast.Name) and node.id == "config") or (
        isinstance(node, ast.Attribute) and node.attr == "config")
