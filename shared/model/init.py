"""A new model's shape and weights: the tiny model's ModelArgs from its config and tokenizer, and HF-style init."""

from __future__ import annotations

import torch

from jetroll.shared.config.model import ModelConfig
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import Tokenizer

INIT_STD = 0.02


def model_args(config: ModelConfig, tokenizer: Tokenizer) -> ModelArgs:
    return ModelArgs(
        vocab_size=tokenizer.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        model_type="qwen2",
        eos_token_id=tokenizer.eos_id,
    )


def init_weights(model: CausalLM) -> None:
    """HF-style init: N(0, 0.02) matrices and embeddings, zero biases, unit norms."""
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(param)
        elif "norm" in name:
            torch.nn.init.ones_(param)
        else:
            torch.nn.init.normal_(param, std=INIT_STD)
