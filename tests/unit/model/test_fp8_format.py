"""The published weight format: vLLM/DeepSeek-V3 block FP8 (`weight` F8_E4M3 [out, in] unpadded + `weight_scale_inv`
F32 [ceil(out/128), ceil(in/128)] + `quantization_config`), loaded back bit for bit by the HF-format loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import load_pretrained, save_pretrained
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.precision import PrecisionLinear
from jetroll.shared.model.tokenizer import build_char_tokenizer
from jetroll.shared.numerics import BLOCK_LINEARS, Numerics

TOKENIZER = build_char_tokenizer()
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}


def safetensors_header(path: Path) -> dict[str, Any]:
    """name -> {dtype, shape, data_offsets}, read from the file's own JSON header."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def tiny_model(precision: Numerics | None = None) -> CausalLM:
    """Dims that are not multiples of 128 (192, 320, 64), an untied lm_head and q/k/v biases."""
    args = ModelArgs(vocab_size=TOKENIZER.vocab_size, hidden_size=192, num_layers=2, num_heads=3, num_kv_heads=1,
                     intermediate_size=320, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return CausalLM(args, precision or Numerics(mode="fp8_unified"))


def linear_names(model: CausalLM) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, PrecisionLinear)]


def linear_bytes(header: dict[str, Any], names: list[str]) -> int:
    return sum(end - start for key, entry in header.items() for start, end in [entry["data_offsets"]]
               if key.rsplit(".", 1)[0] in names and key.rsplit(".", 1)[1] in ("weight", "weight_scale_inv"))


def test_fp8_publication_names_dtypes_and_scale_shapes(tmp_path: Path) -> None:
    model = tiny_model()
    save_pretrained(model, TOKENIZER, tmp_path, publish=Numerics(mode="fp8_unified"))
    header = safetensors_header(tmp_path / "model.safetensors")
    names = linear_names(model)
    assert len(names) == 2 * len(BLOCK_LINEARS)
    for name in names:
        out_features, in_features = model.get_submodule(name).weight.shape
        assert header[f"{name}.weight"]["dtype"] == "F8_E4M3"
        assert header[f"{name}.weight"]["shape"] == [out_features, in_features]  # unpadded
        assert header[f"{name}.weight_scale_inv"]["dtype"] == "F32"
        assert header[f"{name}.weight_scale_inv"]["shape"] == [-(-out_features // 128), -(-in_features // 128)]
    assert header["model.layers.0.mlp.down_proj.weight_scale_inv"]["shape"] == [2, 3]  # [192, 320]
    high_precision = [k for k in header if linear_bytes({k: header[k]}, names) == 0]
    assert {k for k in high_precision if k.endswith(".bias")} == {
        f"model.layers.{i}.self_attn.{p}.bias" for i in range(2) for p in ("q_proj", "k_proj", "v_proj")}
    assert all(header[k]["dtype"] == "F32" for k in high_precision)  # embeddings, norms, lm_head, biases
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(high_precision)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG


def test_fp8_payload_is_at_most_055_of_bf16(tmp_path: Path) -> None:
    model = tiny_model()
    save_pretrained(model, TOKENIZER, tmp_path / "fp8", publish=Numerics(mode="fp8_unified"))
    save_pretrained(model, TOKENIZER, tmp_path / "bf16", publish=Numerics(mode="bf16"))
    fp8, bf16 = (safetensors_header(tmp_path / d / "model.safetensors") for d in ("fp8", "bf16"))
    assert all(bf16[f"{n}.weight"]["dtype"] == "BF16" for n in linear_names(model))
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    ratio = linear_bytes(fp8, linear_names(model)) / linear_bytes(bf16, linear_names(model))
    assert 0.5 < ratio <= 0.55


@pytest.mark.parametrize("scale_rounding", ["none", "pow2"])
def test_published_fp8_loads_back_with_identical_tensors(tmp_path: Path, scale_rounding: str) -> None:
    precision = Numerics(mode="fp8_unified", scale_rounding=scale_rounding)
    model = tiny_model(precision)
    save_pretrained(model, TOKENIZER, tmp_path, publish=precision)
    loaded, _ = load_pretrained(tmp_path, precision)
    published = {n: model.get_submodule(n) for n in linear_names(model)}
    for name, linear in published.items():
        (q, scale_inv), (q2, scale_inv2) = linear.quantized(), loaded.get_submodule(name).quantized()
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale_inv, scale_inv2)
        assert torch.equal(loaded.get_submodule(name).bias, linear.bias) if linear.bias is not None else True
    masters = dict(model.named_parameters())
    for name, param in loaded.named_parameters():
        if name.rsplit(".", 1)[0] not in published:
            assert torch.equal(param, masters[name]), name
    if scale_rounding == "pow2":
        assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    ids = torch.randint(0, TOKENIZER.vocab_size, (2, 12))
    with torch.no_grad():  # the trainer's forward and the loaded rollout model use the same FP8 tensors
        assert torch.equal(model.eval()(ids), loaded.eval()(ids))


def test_high_precision_linears_publish_as_bf16_and_are_listed(tmp_path: Path) -> None:
    precision = Numerics(mode="fp8_unified", high_precision=["gate_proj", "up_proj"])
    model = tiny_model(precision)
    save_pretrained(model, TOKENIZER, tmp_path, publish=precision)
    header = safetensors_header(tmp_path / "model.safetensors")
    assert header["model.layers.1.mlp.gate_proj.weight"]["dtype"] == "BF16"
    assert "model.layers.1.mlp.gate_proj.weight_scale_inv" not in header
    assert header["model.layers.1.mlp.down_proj.weight"]["dtype"] == "F8_E4M3"
    ignored = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignored_layers"]
    assert ignored == [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")]
    loaded, _ = load_pretrained(tmp_path, precision)
    assert loaded.model.layers[0].mlp.gate_proj.fmt == "bf16"


def test_a_scale_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    model = tiny_model()
    save_pretrained(model, TOKENIZER, tmp_path, publish=Numerics(mode="fp8_unified"))
    with pytest.raises(ValueError, match="blocks"):
        load_pretrained(tmp_path, Numerics(mode="fp8_unified", weight_block=64, act_group=64))
