"""Each service's own config (`TrainerSections`, `RolloutSections`): what it needs of the other sections is
resolved at its entry, and no other part of it reads the job's config."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from jetroll.services.rollout.sections import RolloutSections
from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.config.job import validate_config

SERVICES = Path(__file__).resolve().parents[2] / "services"
MIXED = {
    "tasks": [{"name": "arithmetic"}, {"name": "count32", "max_staleness": 3}],
    "staleness": {"mode": "async", "max_staleness": 1},
    "rollout": {"max_new_tokens": 12, "recompute_kv_on_swap": False,
                "pools": [{"name": "fast"}, {"name": "drawn", "engine": "timing"}]},
    "trainer": {"task_quotas": True, "groups_per_step": 8, "group_size": 3, "max_steps": 7},
    "store": {"poll_interval_s": 0.25},
}


def test_the_trainers_sections_resolve_budgets_bounds_and_pools_from_the_other_sections() -> None:
    config = validate_config(MIXED)
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


def test_the_rollout_workers_sections_resolve_its_pool_and_what_it_needs_of_the_trainer_and_the_tasks() -> None:
    flaky = {"name": "calculator", "env_faults": {"delay_s": 0.5, "failure_rate": 0.1}}
    config = validate_config({**MIXED, "tasks": [*MIXED["tasks"], flaky]})
    sections = RolloutSections.of(config, config.build_tasks(), "drawn")
    assert sections.pool.name == "drawn" and sections.pool.engine == "timing"
    assert RolloutSections.of(config, config.build_tasks()).pool.name == "fast"  # no pool named: the first
    assert sections.group_size == 3 and sections.weights_poll_s == 0.25
    assert sections.in_flight_slack == {"arithmetic": 0, "count32": 4, "calculator": 0}
    assert set(sections.env_faults) == {"calculator"} and sections.env_faults["calculator"].delay_s == 0.5
    limits = sections.limits
    assert (limits.group_size, limits.max_version, limits.max_new_tokens) == (3, 7, 12)
    assert limits.tasks == {"arithmetic", "count32", "calculator"} and limits.pools == {"fast", "drawn"}


@pytest.mark.parametrize(("folder", "sections"), [("trainer", TrainerSections), ("rollout", RolloutSections)])
def test_a_service_reads_only_its_own_sections(folder: str, sections: type) -> None:
    """Every `config.X` / `self.config.X` a module of the service reads is a field (or property) of its sections:
    the job's config reaches the service's entry and goes no further."""
    own = {f.name for f in dataclasses.fields(sections)} | {
        name for name, value in vars(sections).items() if isinstance(value, property)}
    reads: dict[str, set[str]] = {}
    for path in sorted((SERVICES / folder).glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _is_config(node.value)}
        if path.name != "sections.py" and names - own:
            reads[path.name] = names - own
    assert reads == {}, reads


def _is_config(node: ast.expr) -> bool:
    """`config` or `self.config`: what a service module calls its config."""
    return (isinstance(node, ast.Name) and node.id == "config") or (
        isinstance(node, ast.Attribute) and node.attr == "config")
