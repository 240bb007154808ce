"""`model.init`: tiny, pretrained, or random weights for the architecture an HF config.json describes, built once per
config, tokenizer and seed, and what the launcher hands the services."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from jetroll.services.launch.run import resolve_config
from jetroll.shared.config.job import validate_config
from jetroll.shared.config.model import ModelConfig
from jetroll.shared.model.checkpoint import load_pretrained, read_weights
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.tasks.registry import TaskSet
from jetroll.shared.warm_start import ensure_base_model

TOKENIZER = build_char_tokenizer()
QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
         "intermediate_size": 96, "max_position_embeddings": 128, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "eos_token_id": 1, "torch_dtype": "bfloat16", "hidden_act": "silu"}


def config_dir(directory: Path, **changes: object) -> Path:
    """config.json and tokenizer files, no weights: what `model.init: random` starts from."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**QWEN3, **changes}))
    TOKENIZER.save(directory)
    return directory


@pytest.mark.parametrize(("fields", "message"), [
    ({"init": "tiny", "path": "/models/x"}, "drop model.path"),
    ({"init": "random"}, "model.init: random needs model.path"),
    ({"init": "pretrained"}, "model.init: pretrained needs model.path"),
    ({"init": "scratch"}, "init"),
])
def test_init_and_path_must_agree(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelConfig(**fields)


def test_random_init_builds_the_configs_architecture_once_per_seed(tmp_path: Path) -> None:
    source = config_dir(tmp_path / "qwen3")
    config = ModelConfig(init="random", path=str(source), cache_dir=str(tmp_path / "cache"))
    built = ensure_base_model(config, TaskSet())
    model, tokenizer = load_pretrained(built)
    assert (model.args.model_type, model.args.head_dim, model.args.num_layers, model.args.vocab_size) == \
        ("qwen3", 24, 2, 96)
    assert tokenizer.vocab_size == TOKENIZER.vocab_size
    info = json.loads((built / "random_init.json").read_text())
    assert info["parameters"] == sum(p.numel() for p in model.parameters()) and info["seed"] == 0
    std = model.model.layers[0].mlp.down_proj.weight.std().item()
    assert 0.015 < std < 0.025  # HF-style N(0, 0.02), not an untouched torch default
    made = (built / "model.safetensors").stat().st_mtime_ns
    assert ensure_base_model(config, TaskSet()) == built and (built / "model.safetensors").stat().st_mtime_ns == made

    elsewhere = ensure_base_model(config.model_copy(update={"cache_dir": str(tmp_path / "other")}), TaskSet())
    assert elsewhere.name == built.name  # the cache key is what the build reads, not where it lives
    first, again = read_weights(built), read_weights(elsewhere)
    assert all(torch.equal(first[k], again[k]) for k in first)
    reseeded = ensure_base_model(config.model_copy(update={"init_seed": 1}), TaskSet())
    assert reseeded != built
    assert not torch.equal(read_weights(reseeded)["lm_head.weight"], first["lm_head.weight"])
    config_dir(source, num_hidden_layers=3)
    assert ensure_base_model(config, TaskSet()) != built  # another config.json, another model


def test_random_init_refuses_what_a_checkpoint_would(tmp_path: Path) -> None:
    source = config_dir(tmp_path / "odd", sliding_window=16, use_sliding_window=True)
    with pytest.raises(ValueError, match="config.json: .*sliding"):
        ensure_base_model(ModelConfig(init="random", path=str(source), cache_dir=str(tmp_path / "cache")),
                          TaskSet())
    with pytest.raises(FileNotFoundError, match="needs config.json"):
        ensure_base_model(ModelConfig(init="random", path=str(tmp_path / "none"), cache_dir=str(tmp_path / "c")),
                          TaskSet())
    assert not list((tmp_path / "cache").glob("random-*"))  # nothing half-built is left to be found later


def test_the_launcher_hands_the_services_the_built_model(tmp_path: Path) -> None:
    source = config_dir(tmp_path / "qwen3")
    tree = {"model": {"init": "random", "path": str(source), "cache_dir": str(tmp_path / "cache")},
            "tasks": [{"name": "arithmetic", "weight": 1.0}]}
    resolved = resolve_config(validate_config(tree), tmp_path / "run")
    assert resolved.model.init == "pretrained"
    assert Path(resolved.model.path).parent == tmp_path / "cache"
    assert (Path(resolved.model.path) / "random_init.json").is_file()
