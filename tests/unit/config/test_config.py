"""Job config: every YAML in configs/ loads, `--set` overrides parse types, errors are one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetroll.shared.config.job import JobConfig, load_config
from jetroll.shared.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))
SMOKE = CONFIGS[0].parent / "smoke.yaml"


def test_configs_dir_is_not_empty() -> None:
    assert {p.name for p in CONFIGS} >= {"arithmetic.yaml", "smoke.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_loads(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, JobConfig)
    assert config.rollout.max_batch >= config.trainer.group_size


def test_smoke_config_is_tiny() -> None:
    config = load_config(SMOKE)
    assert (config.model.hidden_size, config.model.num_layers, config.model.warm_start.max_steps) == (128, 1, 20)
    assert (config.trainer.max_steps, config.trainer.groups_per_step, config.trainer.group_size) == (4, 4, 4)
    assert config.rollout.max_seq_len == 32 and config.eval.num_problems == 20
    assert config.redis.claim_idle_ms == 2000


def test_defaults_without_a_file() -> None:
    config = load_config(None)
    assert config.precision.mode == "fp32" and config.staleness.eta == 2


def test_overrides_parse_types() -> None:
    config = load_config(SMOKE, [
        "trainer.lr=1e-4",  # YAML 1.1 reads this as a string; the float field still gets 1e-4
        "trainer.max_steps=7",
        "rollout.recompute_kv_on_swap=false",
        "model.tie_word_embeddings=no",
        "precision.decoupled_band=[0.1, 5]",
        "model.warm_start.tasks=[arithmetic, count]",
        "tasks=[{name: arithmetic, weight: 2}, {name: count}]",
        "staleness.mode=sync",
        "job_id=abc123",
    ])
    assert isinstance(config.trainer.lr, float) and config.trainer.lr == pytest.approx(1e-4)
    assert config.trainer.max_steps == 7 and isinstance(config.trainer.max_steps, int)
    assert config.rollout.recompute_kv_on_swap is False and config.model.tie_word_embeddings is False
    assert config.precision.decoupled_band == (0.1, 5.0)
    assert config.model.warm_start.tasks == ["arithmetic", "count"]
    assert [(t.name, t.weight) for t in config.tasks] == [("arithmetic", 2.0), ("count", 1.0)]
    assert config.staleness.eta == 0 and config.job_id == "abc123"


def test_override_value_may_contain_equals() -> None:
    assert load_config(SMOKE, ["store.root=/tmp/a=b"]).store.root == "/tmp/a=b"


def test_numeric_job_id_override() -> None:
    assert load_config(SMOKE, ["job_id=1234"]).job_id == "1234"


def _error(overrides: list[str], path: Path | None = SMOKE) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("override", "names"), [
    ("trainer.lr=-1", ["trainer.lr"]),
    ("trainer.max_steps=abc", ["trainer.max_steps"]),
    ("precision.mode=fp16", ["precision.mode"]),
    ("rollout.temperature=0", ["rollout.temperature"]),
])
def test_bad_value_names_the_key(override: str, names: list[str]) -> None:
    message = _error([override])
    assert all(name in message for name in names), message


@pytest.mark.parametrize(("override", "name"), [("trainer.bogus=1", "trainer.bogus"),
                                              ("bogus_section.x=1", "bogus_section"),
                                              ("model.warm_start.bogus=2", "model.warm_start.bogus"),
                                              # the loss's correction owns C and its band: the old keys are gone
                                              ("trainer.behavior_cap=2", "trainer.behavior_cap"),
                                              ("trainer.behavior_band=[0, 10]", "trainer.behavior_band")])
def test_unknown_key_is_named(override: str, name: str) -> None:
    message = _error([override])
    assert name in message and "unknown key" in message, message


def test_unknown_top_level_key_in_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMOKE.read_text() + "\nbogus_section:\n  x: 1\n")
    message = _error([], bad)
    assert "bogus_section" in message and "unknown key" in message


def test_unreadable_or_non_mapping_yaml(tmp_path: Path) -> None:
    assert "cannot read config" in _error([], tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert "mapping" in _error([], tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("trainer: [1, 2\n")
    assert "cannot read config" in _error([], tmp_path / "broken.yaml")


def test_override_without_equals() -> None:
    assert "expected key=value" in _error(["trainer.lr"])


def test_override_through_a_scalar() -> None:
    assert "precision.mode.x" in _error(["precision.mode.x=1"])


def test_an_override_names_a_list_element_by_its_index(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text("tasks: [{name: arithmetic, weight: 1.0}, {name: calculator, weight: 1.0,"
                    " env_faults: {delay_s: 0.2}}]\n")
    config = load_config(path, ["tasks.0.weight=3", "tasks.1.env_faults=null"])
    assert [(t.name, t.weight, t.env_faults) for t in config.tasks] == [("arithmetic", 3.0, None),
                                                                           ("calculator", 1.0, None)]
    assert "tasks is a list of 2; '2' is not an index in it" in _error(["tasks.2.weight=1"], path)
    assert "tasks is a list of 2; 'first' is not an index in it" in _error(["tasks.first.weight=1"], path)


@pytest.mark.parametrize(("overrides", "fields"), [
    (["rollout.max_batch=2"], ["rollout.max_batch", "trainer.group_size"]),
    (["model.num_heads=3"], ["model.hidden_size", "model.num_heads"]),
    (["model.num_heads=2", "model.num_kv_heads=3"], ["model.num_heads", "model.num_kv_heads"]),
])
def test_cross_field_error_names_both_fields(overrides: list[str], fields: list[str]) -> None:
    message = _error(overrides)
    assert all(field in message for field in fields), message


def test_unknown_task_lists_the_valid_ones() -> None:
    message = _error(["tasks=[{name: nope}]"])
    assert "tasks.0.name" in message and "arithmetic" in message
