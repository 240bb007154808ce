"""A model's shape and the HF `config.json` it reads from and writes to.

Every key of a config.json is used, listed in IRRELEVANT_KEYS (it cannot change what the model computes here), or
refused with one line: nothing the loader does not understand loads silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jetroll.shared.model.rope import RopeScaling

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# keys that cannot change the numerics of the forward pass here: names, serialization and cache hints, training-time
# init, the tokenizer's ids (read from the tokenizer files), and sliding-window sizes when no window is used
IRRELEVANT_KEYS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "name_or_path",
    "initializer_range", "use_cache", "bos_token_id", "pad_token_id", "pretraining_tp", "max_window_layers",
    "sliding_window", "output_attentions", "output_hidden_states", "return_dict", "tie_encoder_decoder",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
})
USED_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "rms_norm_eps", "tie_word_embeddings", "attention_bias", "eos_token_id", "hidden_act", "use_sliding_window",
    "layer_types", "mlp_bias", "attention_dropout", "partial_rotary_factor", "quantization_config",
})


@dataclass(frozen=True, slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = True  # Qwen2 has q/k/v biases, Llama and Qwen3 none
    model_type: str = "qwen2"
    eos_token_id: int = 1
    extra_eos_token_ids: tuple[int, ...] = ()  # further ids that end a sample (Llama-3 lists three)
    explicit_head_dim: int | None = None  # Qwen3's head_dim, which is not hidden / heads
    rope_scaling: RopeScaling | None = None

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"  # per-head RMSNorm of q and k, before RoPE

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id, *self.extra_eos_token_ids)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelArgs:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        refuse_what_changes_numerics(config)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != hidden // heads and model_type != "qwen3":
            raise ValueError(f"head_dim {head_dim} != hidden_size / num_attention_heads is a qwen3 shape; "
                             f"model_type is {model_type!r}")
        rope_parameters = config.get("rope_parameters") or {}
        eos = config.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        if not eos_ids or not all(isinstance(i, int) for i in eos_ids):
            raise ValueError(f"eos_token_id must be an id or a list of ids, got {eos!r}")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config["max_position_embeddings"],
            rope_theta=float(config.get("rope_theta", rope_parameters.get("rope_theta", 1e4))),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", model_type == "qwen2"),
            model_type=model_type,
            eos_token_id=eos_ids[0],
            extra_eos_token_ids=tuple(dict.fromkeys(eos_ids[1:])),
            explicit_head_dim=head_dim if head_dim != hidden // heads else None,
            rope_scaling=RopeScaling.from_hf(config.get("rope_scaling") or rope_parameters),
        )

    def to_hf(self) -> dict[str, Any]:
        config = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "eos_token_id": list(self.eos_token_ids) if self.extra_eos_token_ids else self.eos_token_id,
            "bos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            "use_sliding_window": False,
        }
        if self.model_type != "qwen2":
            config["attention_bias"] = self.attention_bias
        return config


def refuse_what_changes_numerics(config: dict[str, Any]) -> None:
    """One clear line for a key jetroll does not understand, remote code, or a setting it does not implement."""
    if "auto_map" in config:
        raise ValueError("this checkpoint needs trust_remote_code (its config.json has auto_map): jetroll runs only "
                         f"its own implementations of {', '.join(SUPPORTED_MODEL_TYPES)}")
    if unknown := sorted(set(config) - USED_KEYS - IRRELEVANT_KEYS):
        raise ValueError(f"config.json keys {unknown} are not understood; jetroll refuses what might change the "
                         "numerics rather than ignore it")
    if (act := config.get("hidden_act", "silu")) not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported: jetroll's MLP is SwiGLU with silu")
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window is not supported: jetroll attends over the whole sequence")
    if any(kind != "full_attention" for kind in config.get("layer_types") or []):
        raise ValueError(f"layer_types {sorted(set(config['layer_types']))}: only full_attention is supported")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported: jetroll's MLP projections have no bias")
    if config.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout {config['attention_dropout']} is not supported: jetroll trains "
                         "without dropout")
    if (partial := config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported: jetroll rotates every head dim")
    if config.get("rope_scaling") and config.get("rope_parameters"):
        raise ValueError("config.json has both rope_scaling and rope_parameters: keep one")
