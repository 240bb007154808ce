"""HF checkpoints as they ship: Qwen2, Qwen3 and Llama with every supported RoPE variant match transformers' logits
past the original context, sharded bf16 checkpoints follow their index, every eos id counts, what the loader does
not understand is refused in one line, and a published version reloads in transformers with the same logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from jetroll.shared.engine.engine import Engine
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_pretrained, save_pretrained, save_tensors
from jetroll.shared.model.tokenizer import build_char_tokenizer, load_tokenizer

TOKENIZER = build_char_tokenizer()
ORIGINAL_CONTEXT = 16  # small, so the test's 48 positions run well past it
SEQ = 48
SHAPE = {"vocab_size": TOKENIZER.vocab_size, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 64, "rope_theta": 500.0,
         "eos_token_id": 1, "initializer_range": 0.15}  # large enough weights that attention, so RoPE, matters
CONFIGS = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}
# each variant's parameters in the rope_type spelling; every one changes the frequencies inside the test's span
ROPES: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL_CONTEXT},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT},
}


def hf_checkpoint(directory: Path, model_type: str, rope: dict[str, Any] | None, *, dtype: torch.dtype = torch.float32,
                  shard: str | None = None, **extra: Any) -> transformers.PreTrainedModel:
    """A random-init transformers model saved as it ships (safetensors, its own config.json) with a tokenizer."""
    kwargs = {**SHAPE, **({"head_dim": 24} if model_type == "qwen3" else {}), **extra}
    if rope is not None:
        kwargs["rope_parameters"] = {"rope_theta": SHAPE["rope_theta"], **rope}
    config = CONFIGS[model_type](**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype)
    with torch.no_grad():  # spread the norms and biases, so a wrong norm or bias shows in the logits
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    TOKENIZER.save(directory)
    return model.eval()


def hf_logprobs(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


def jetroll_logprobs(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    model, _ = load_pretrained(directory)
    with torch.no_grad():
        return torch.log_softmax(model.eval()(ids), dim=-1)


def token_ids() -> torch.Tensor:
    return torch.randint(2, TOKENIZER.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_logits_match_transformers_past_the_original_context(tmp_path: Path, model_type: str, rope: str) -> None:
    reference = hf_checkpoint(tmp_path, model_type, ROPES[rope])
    ids = token_ids()
    expected = hf_logprobs(reference, ids)
    got = jetroll_logprobs(tmp_path, ids)
    assert (got - expected).abs().max().item() <= 1e-4
    if rope != "default":  # the variant matters here: the default RoPE's logits are other ones
        default = transformers.AutoModelForCausalLM.from_config(
            CONFIGS[model_type](**{**json.loads((tmp_path / "config.json").read_text()), "rope_parameters": None}),
            attn_implementation="eager")
        default.load_state_dict(reference.state_dict())
        assert (hf_logprobs(default.eval(), ids) - expected).abs().max().item() > 1e-2
        # the older spelling, rope_scaling with `type`, loads the same model
        config = json.loads((tmp_path / "config.json").read_text())
        params = {k: v for k, v in config.pop("rope_parameters").items() if k != "rope_theta"}
        config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
        config["rope_theta"] = SHAPE["rope_theta"]
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert torch.equal(jetroll_logprobs(tmp_path, ids), got)


def test_a_sharded_bf16_checkpoint_loads_through_its_index(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path, "llama", ROPES["llama3"], dtype=torch.bfloat16, shard="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                  attn_implementation="eager")
    ids = token_ids()
    assert (jetroll_logprobs(tmp_path, ids) - hf_logprobs(reference.eval(), ids)).abs().max().item() <= 1e-4


def test_stray_and_misplaced_tensors_are_refused(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path, "qwen2", None, shard="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    save_file({"extra": torch.zeros(2)}, str(tmp_path / "model-stray.safetensors"))
    with pytest.raises(ValueError, match=r"\['model-stray.safetensors'\] are not in model.safetensors.index.json"):
        load_pretrained(tmp_path)
    (tmp_path / "model-stray.safetensors").unlink()
    # a tensor duplicated into a second shard: the map names one home for it
    key, home = next(iter(index["weight_map"].items()))
    other = next(name for name in sorted(set(index["weight_map"].values())) if name != home)
    tensors = load_file(str(tmp_path / other)) | {key: load_file(str(tmp_path / home))[key]}
    save_file(tensors, str(tmp_path / other))
    with pytest.raises(ValueError, match=f"holds {key}, which model.safetensors.index.json puts in {home}"):
        load_pretrained(tmp_path)


def test_several_safetensors_without_an_index_are_refused(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path, "qwen2", None)
    save_file({"extra": torch.zeros(2)}, str(tmp_path / "more.safetensors"))
    with pytest.raises(FileNotFoundError, match="needs model.safetensors, or an model.safetensors.index.json"):
        load_pretrained(tmp_path)


def test_every_eos_id_ends_a_sample_and_survives_a_publish(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path, "llama", None, eos_token_id=[1, 5, 7])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9], "temperature": 0.6}))
    model, tokenizer = load_pretrained(tmp_path)
    assert model.args.eos_token_ids == (1, 5, 7, 9)
    assert Engine(model, tokenizer.eos_id, max_batch=1, max_len=8).stop_ids == {1, 5, 7, 9}
    save_pretrained(model, tokenizer, tmp_path / "published")
    assert json.loads((tmp_path / "published" / "config.json").read_text())["eos_token_id"] == [1, 5, 7, 9]


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "mistral"}, "unsupported model_type 'mistral'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0}}, "unsupported rope type 'longrope'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}},
     "rope type 'dynamic' is refused"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 500.0, "beta_fastest": 3}},
     r"rope type 'yarn' does not read \['beta_fastest'\]"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 2.0, "rope_theta": 500.0}}, "rope type 'llama3' needs"),
    ({"logit_softcapping": 30.0}, r"keys \['logit_softcapping'\] are not understood"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, "needs trust_remote_code"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"head_dim": 24}, "is a qwen3 shape"),
])
def test_what_the_loader_does_not_understand_is_refused_in_one_line(tmp_path: Path, change: dict[str, Any],
                                                                     message: str) -> None:
    hf_checkpoint(tmp_path, "llama", None)
    config = json.loads((tmp_path / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as caught:
        load_pretrained(tmp_path)
    assert "\n" not in str(caught.value)


def test_a_published_version_reloads_in_transformers_with_the_same_logits_and_tokenizer_files(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path / "hf", "qwen3", ROPES["yarn"])
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    (tmp_path / "hf" / "chat_template.jinja").write_text(template)
    model, tokenizer = load_pretrained(tmp_path / "hf")
    save_pretrained(model, tokenizer, tmp_path / "published")
    assert (tmp_path / "published" / "chat_template.jinja").read_text() == template
    assert (tmp_path / "published" / "tokenizer_config.json").read_text() == \
        (tmp_path / "hf" / "tokenizer_config.json").read_text()
    assert ModelArgs.from_hf(json.loads((tmp_path / "published" / "config.json").read_text())) == model.args
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "published", attn_implementation="eager")
    ids = token_ids()
    assert (hf_logprobs(reloaded.eval(), ids) - jetroll_logprobs(tmp_path / "hf", ids)).abs().max().item() <= 1e-4


def test_a_tensor_file_that_cannot_be_written_raises_the_os_error_it_is(tmp_path: Path) -> None:
    """The commit tells a full disk (ENOSPC) from a bug by the errno: safetensors' writer hides it in a message."""
    tensors = {"w": torch.ones(4)}
    save_tensors(tmp_path / "w.safetensors", tensors, metadata={"format": "pt"})
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], tensors["w"])
    with pytest.raises(FileNotFoundError, match="missing/w.safetensors"):
        save_tensors(tmp_path / "missing" / "w.safetensors", tensors)


def test_a_tokenizer_that_cannot_be_written_raises_the_os_error_it_is(tmp_path: Path) -> None:
    """The tokenizers library's own writer raised a bare Exception ("No space left on device (os error 28)"), which a
    full store's commit took for a bug and restarted the trainer on: the file is written by Python now."""
    tokenizer = build_char_tokenizer()
    tokenizer.save(tmp_path)
    assert load_tokenizer(tmp_path).encode("12+34=") == tokenizer.encode("12+34=")
    with pytest.raises(FileNotFoundError, match="missing/tokenizer.json"):
        tokenizer.save(tmp_path / "missing")
