"""A model's shape and the HF `config.json` it reads from and writes to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


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
    attention_bias: bool = True  # Qwen2 has q/k/v biases, Llama has none
    model_type: str = "qwen2"
    eos_token_id: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelArgs:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        if config.get("head_dim", hidden // heads) != hidden // heads:
            raise ValueError("head_dim != hidden_size / num_attention_heads is not supported")
        eos = config.get("eos_token_id", 1)
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config["max_position_embeddings"],
            rope_theta=float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 1e4))),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", model_type == "qwen2"),
            model_type=model_type,
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    def to_hf(self) -> dict[str, Any]:
        arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[self.model_type]
        config = {
            "architectures": [arch],
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
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            "use_sliding_window": False,
        }
        if self.model_type == "llama":
            config["attention_bias"] = self.attention_bias
        return config
