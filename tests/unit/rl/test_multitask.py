"""Multi-task: per-task quotas in the trainer's take, per-task in-flight caps at admission, and pool routing."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from factories import sample_with_versions as trajectory
from factories import scored

from jetroll.services.controller.routing import route_tasks, task_profile
from jetroll.services.trainer.sections import TrainerSections
from jetroll.shared.config.job import load_config
from jetroll.shared.errors import ConfigError
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.rl.admission import (
    Admission,
    admission_window,
    in_flight_caps,
    in_flight_slack,
    task_quotas,
)
from jetroll.shared.rl.batch import GroupBuffer
from jetroll.shared.tasks.registry import TASKS

MIX = ["tasks=[{name: arithmetic, weight: 3}, {name: count, weight: 1}]", "trainer.groups_per_step=4"]


def fill(buffer: GroupBuffer, groups: list[tuple[str, str, int]]) -> None:
    for group, task, v_adm in groups:
        for sample in range(2):
            buffer.add(f"{group}-{sample}", scored(trajectory(group, sample, [v_adm], v_adm=v_adm, task=task)))


def test_quotas_follow_the_weights_and_sum_to_b() -> None:
    config = load_config(None, MIX)
    assert task_quotas(config) == {"arithmetic": 3, "count": 1}
    assert in_flight_caps(config) == {"arithmetic": 9, "count": 3}  # shares of (eta 2 + 1) * 4
    odd = load_config(None, ["tasks=[{name: arithmetic}, {name: count}]", "trainer.groups_per_step=5"])
    assert sum(task_quotas(odd).values()) == 5


def test_a_task_with_its_own_staleness_bound_gets_its_room_and_its_slack() -> None:
    """count (a quarter of B = 4) keeps eta 6 against the job's 2: its cap is its share of 7 versions of B, the
    window grows by its share of the 4 versions more, and its in-flight scores sit 8 versions later (eta_hard 12
    against 4), so the trainer's one query at the job's eta_hard finds its groups 8 versions later."""
    config = load_config(None, ["tasks=[{name: arithmetic, weight: 3}, {name: count, weight: 1, max_staleness: 6}]",
                                "trainer.groups_per_step=4"])
    assert [config.task_eta(t) for t in ("arithmetic", "count")] == [2, 6]
    assert TrainerSections.of(config, config.build_tasks()).max_eta_hard == 12
    assert in_flight_caps(config) == {"arithmetic": 9, "count": 7}
    assert admission_window(config) == 12 + 4  # (2 + 1) * 4, and count's quarter of 4 more versions of 4
    assert in_flight_slack(config) == {"arithmetic": 0, "count": 8}
    plain = load_config(None, MIX)
    assert admission_window(plain) == 12 and in_flight_slack(plain) == {"arithmetic": 0, "count": 0}
    sync = load_config(None, ["tasks=[{name: arithmetic}, {name: count}]", "staleness.mode=sync"])
    assert sync.task_eta("count") == 0 and admission_window(sync) == sync.trainer.groups_per_step
    with pytest.raises(ConfigError, match="tasks.1.max_staleness: a task's own staleness bound needs staleness.mode "
                                          "async"):
        load_config(None, ["tasks=[{name: arithmetic}, {name: count, max_staleness: 6}]", "staleness.mode=sync"])


def test_take_gives_each_task_its_quota_before_the_oldest_rest() -> None:
    buffer = GroupBuffer()
    # five old arithmetic groups, then two newer count groups
    fill(buffer, [(f"a{i}", "arithmetic", 0) for i in range(5)] + [("c0", "count", 1), ("c1", "count", 1)])
    taken = buffer.take_oldest(4, quotas={"arithmetic": 3, "count": 1})
    assert taken is not None
    assert Counter(g.task for g in taken) == {"arithmetic": 3, "count": 1}
    # plain oldest-first would have taken four arithmetic groups
    fill(buffer, [(f"b{i}", "arithmetic", 0) for i in range(4)])
    plain = buffer.take_oldest(4)
    assert plain is not None and {g.task for g in plain} == {"arithmetic"}


def test_a_missing_task_leaves_its_quota_to_the_others() -> None:
    buffer = GroupBuffer()
    fill(buffer, [(f"a{i}", "arithmetic", i) for i in range(4)])  # no count group complete: count is slow
    taken = buffer.take_oldest(4, quotas={"arithmetic": 3, "count": 1})
    assert taken is not None and [g.group_id for g in taken] == ["a0", "a1", "a2", "a3"]


def test_required_groups_still_come_first_with_quotas() -> None:
    buffer = GroupBuffer()
    fill(buffer, [("a0", "arithmetic", 0), ("a1", "arithmetic", 0), ("c0", "count", 0)])
    taken = buffer.take_oldest(2, frozenset({"a1"}), quotas={"arithmetic": 1, "count": 1})
    assert taken is not None and {g.group_id for g in taken} == {"a1", "c0"}


def test_admission_skips_a_task_at_its_cap() -> None:
    admission = Admission(4, 12, 100, task_weights={"arithmetic": 1.0, "count": 1.0},
                          task_caps={"arithmetic": 6, "count": 6})
    rng = random.Random(0)
    assert {admission.pick_task({"count": 6}, rng) for _ in range(50)} == {"arithmetic"}
    assert admission.pick_task({"count": 6, "arithmetic": 6}, rng) is None
    uncapped = Admission(4, 12, 100, task_weights={"arithmetic": 1.0, "count": 1.0})
    assert {uncapped.pick_task({"count": 60}, rng) for _ in range(50)} == {"arithmetic", "count"}


def test_routing_by_task_then_profile_then_first_pool() -> None:
    tokenizer = build_char_tokenizer()
    assert task_profile(TASKS["count"], tokenizer) == "decode_heavy"
    assert task_profile(TASKS["arithmetic"], tokenizer) == "prefill_heavy"
    config = load_config(None, ["tasks=[{name: arithmetic}, {name: count}]",
                                "rollout.pools=[{name: short}, {name: long, profile: decode_heavy}]"])
    routes = route_tasks(config.rollout, TASKS, ["arithmetic", "count"], tokenizer)
    assert routes == {"arithmetic": "short", "count": "long"}
    explicit = load_config(None, ["tasks=[{name: arithmetic}, {name: count}]",
                                  "rollout.pools=[{name: p1, profile: decode_heavy}, {name: p2, tasks: [count]}]"])
    routes = route_tasks(explicit.rollout, TASKS, ["arithmetic", "count"], tokenizer)
    assert routes == {"arithmetic": "p1", "count": "p2"}


@pytest.mark.parametrize(("pools", "needle"), [
    ("[{name: a}, {name: a}]", "duplicate pool names"),
    ("[{name: a, tasks: [count]}, {name: b, tasks: [count]}]", "two pools"),
    ("[{name: a, tasks: [nope]}]", "unknown task 'nope'"),
    ("[{name: 'bad name'}]", "rollout.pools.0.name"),
    ("[{name: a, num_workers: 3, max_workers: 2}]", "max_workers"),
])
def test_bad_pools_fail_with_one_clear_line(pools: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"rollout.pools={pools}"])
    assert needle in str(err.value) and "\n" not in str(err.value)
