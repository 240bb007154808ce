"""`rollout.max_new_tokens` caps every task's generation budget: the controller's groups on a real Redis carry
min(the task's budget, the cap)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from jetroll.functions.scoring import job_tasks
from jetroll.services.controller.controller import Controller
from jetroll.shared.config.job import JobConfig, validate_config
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.events import GroupEvent, decode
from jetroll.shared.store import setup_store
from jetroll.shared.tasks.registry import TASKS

pytestmark = pytest.mark.integration


async def admitted_budgets(config: JobConfig, redis_url: str, run_dir: Path) -> dict[str, set[int]]:
    """One admission round of a real Controller: the max_new_tokens its groups carry, by task."""
    bus = RedisBus(redis_url, config.job_id)
    try:
        store = setup_store(config.store, config.job_id, run_dir)
        controller = Controller(config, job_tasks(config), bus, store, run_dir)
        await controller._admit()
        budgets: dict[str, set[int]] = {}
        for _, fields in await bus.redis.xrange(bus.key("groups:default")):
            group = decode(fields[b"e"])
            assert isinstance(group, GroupEvent)
            budgets.setdefault(group.task, set()).add(group.max_new_tokens)
        return budgets
    finally:
        await bus.redis.aclose()


@pytest.mark.parametrize("cap", [None, 20])
def test_controller_caps_each_tasks_budget(cap: int | None, redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    build_char_tokenizer().save(tmp_path / "model")  # the controller reads only the tokenizer
    tree = {"job_id": f"b{uuid.uuid4().hex[:8]}", "model": {"path": str(tmp_path / "model")},
            "tasks": [{"name": "arithmetic"}, {"name": "count"}], "store": {"root": str(tmp_path / "store")},
            "trainer": {"groups_per_step": 8}}
    if cap is not None:
        tree["rollout"] = {"max_new_tokens": cap}
    config = validate_config(tree)
    budgets = asyncio.run(admitted_budgets(config, redis_url, tmp_path))
    own = {name: TASKS[name].max_new_tokens for name in ("arithmetic", "count")}
    assert own["arithmetic"] < 20 < own["count"]
    expected = own if cap is None else {name: min(budget, cap) for name, budget in own.items()}
    assert budgets == {name: {budget} for name, budget in expected.items()}
