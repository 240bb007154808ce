"""Write configs/models/qwen2.5-0.5b-shape: Qwen2.5-0.5B's config.json as it ships (its ids pointed at the tokenizer
here) and a byte-level BPE tokenizer trained on generated arithmetic, since nothing can be downloaded from a model hub.
`model.init: random` builds the weights (configs/bench_qwen2.5_0.5b.yaml). Run from the repository root."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path("configs/models/qwen2.5-0.5b-shape")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN25_05B = {  # huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json, but for the token ids
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def main() -> None:
    rng = random.Random(0)
    corpus = [f"{a}{op}{b}={a + b if op == '+' else a - b}" for a, b, op in
              ((rng.randrange(1000), rng.randrange(1000), rng.choice("+-")) for _ in range(20000))]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    OUT.mkdir(parents=True, exist_ok=True)
    backend.save(str(OUT / "tokenizer.json"))
    eos = backend.token_to_id("<|endoftext|>")
    (OUT / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        indent=2) + "\n")
    config = {**QWEN25_05B, "bos_token_id": eos, "eos_token_id": eos}
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{OUT}: {backend.get_vocab_size()} tokens, embedding rows {config['vocab_size']}")


if __name__ == "__main__":
    main()
