"""Chat templates render as transformers renders them, on a BPE tokenizer trained here; embedding rows the
tokenizer has no string for are never sampled and never trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from chat_models import LLAMA_TEMPLATE, QWEN_TEMPLATE, bpe_model_dir

from jetroll.shared.config.job import validate_config
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.errors import ConfigError
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.rl.loss import token_entropy, token_logprobs
from jetroll.shared.tasks.base import Problem


@pytest.mark.parametrize("system", [None, "Answer with a number only."])
@pytest.mark.parametrize("template", ["qwen", "llama"])
def test_a_prompt_renders_as_transformers_renders_it(tmp_path: Path, template: str, system: str | None) -> None:
    text, bos = (QWEN_TEMPLATE, None) if template == "qwen" else (LLAMA_TEMPLATE, "<|begin_of_text|>")
    directory = bpe_model_dir(tmp_path, text, bos)
    tokenizer = load_tokenizer(directory)
    config = validate_config({"model": {"path": str(directory), "chat_template": True, "system_prompt": system}})
    prompts = PromptFormat.of(config.model, tokenizer)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                                  chat_template=text, bos_token=bos, eos_token="<|im_end|>")
    messages = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": "7+31="}]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompts.text(Problem("7+31=", "38")) == expected
    ids = prompts.ids(Problem("7+31=", "38"))
    assert ids == theirs.encode(expected, add_special_tokens=False)
    if bos:  # the template's {{ bos_token }} is the BOS id, once
        assert ids[0] == tokenizer.backend.token_to_id(bos) and ids.count(ids[0]) == 1
    assert tokenizer.backend.token_to_id("<|im_start|>" if template == "qwen" else "<|eot_id|>") in ids


def test_a_chat_template_needs_a_model_that_ships_one(tmp_path: Path) -> None:
    directory = bpe_model_dir(tmp_path, QWEN_TEMPLATE)
    meta = json.loads((directory / "tokenizer_config.json").read_text())
    del meta["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(meta))
    config = validate_config({"model": {"path": str(directory), "chat_template": True}})
    with pytest.raises(ConfigError, match="ships no chat template"):
        PromptFormat.of(config.model, load_tokenizer(directory))
    with pytest.raises(ValueError, match="system_prompt needs model.chat_template"):
        validate_config({"model": {"system_prompt": "Be brief."}})
    assert PromptFormat.of(validate_config({}).model, load_tokenizer(directory)).text(Problem("1+1=", "2")) == "1+1="


def test_ids_without_a_string_are_never_sampled_nor_trained_on() -> None:
    """An embedding of 96 rows over a 60-token tokenizer: the 36 rows past it get -inf logits in every pass."""
    torch.manual_seed(0)
    model = CausalLM(ModelArgs(vocab_size=96, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                               intermediate_size=128, max_position_embeddings=64))
    with torch.no_grad():
        model.lm_head.weight[60:] += 5.0  # the rows past the tokenizer would win most draws
    model.mask_ids_past(60)
    ids = torch.randint(0, 60, (2, 12))
    logits = model(ids)
    assert torch.isneginf(logits[..., 60:]).all() and torch.isfinite(logits[..., :60]).all()
    assert torch.isfinite(token_logprobs(logits, ids, 1.0)).all() and torch.isfinite(token_entropy(logits, 1.0)).all()
    loss = -token_logprobs(model(ids), ids, 1.0).mean()
    loss.backward()
    assert torch.isfinite(model.lm_head.weight.grad).all() and model.lm_head.weight.grad[60:].abs().sum() == 0
    engine = Engine(model, eos_id=0, max_batch=8, max_len=64, seed=3)
    requests = [Request(request_id=str(i), prompt_ids=[1, 2, 3], max_new_tokens=40, temperature=1.0,
                        ignore_eos=True) for i in range(8)]
    engine.generate(requests)
    sampled = [t for r in requests for t in r.output_ids]
    assert len(sampled) == 8 * 40 and max(sampled) < 60
