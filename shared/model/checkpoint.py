"""HF-format model directories: config.json, safetensors weights (fp32 masters, or as rollout computes with them)
and the tokenizer files."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from jetroll.shared.errors import JobFailedError
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.precision import PrecisionLinear, quantization_config
from jetroll.shared.model.tokenizer import Tokenizer, load_tokenizer
from jetroll.shared.numerics import Numerics, QuantizationPlan

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def save_pretrained(
    model: CausalLM, tokenizer: Tokenizer | None, directory: str | Path, publish: Numerics | None = None
) -> None:
    """Write an HF-format directory: config.json, model.safetensors and the tokenizer files.

    Without `publish`, every tensor is the fp32 master (checkpoints, base models). With the job's precision as
    `publish`, block linears are written in their rollout format: FP8 ones as `weight` (F8_E4M3, [out, in],
    unpadded) plus `weight_scale_inv` (fp32, [ceil(out/128), ceil(in/128)]) and a `quantization_config` in
    config.json, as vLLM and DeepSeek-V3 read them; bf16 ones as bf16. Everything else stays fp32.
    """
    write_pretrained(directory, *pretrained_tensors(model, publish), tokenizer)


def pretrained_tensors(model: CausalLM, publish: Numerics | None = None,
                       is_refit: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What `save_pretrained` writes: the tensors (the masters as views of the live parameters, or the published
    formats; `is_refit` for a version after the base) and config.json's fields."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.args.to_hf()
    if publish is not None:
        ignored = []
        for name, module in model.named_modules():
            if isinstance(module, PrecisionLinear):
                state.update({f"{name}.{k}": v for k, v in module.published(publish, is_refit).items()})
                if publish.linear_format(module.name) != "fp8":
                    ignored.append(name)
        if (quantization := quantization_config(publish, ignored)) is not None:
            config["quantization_config"] = quantization
    return state, config


def quantization_plan(args: ModelArgs, publish: Numerics) -> QuantizationPlan:
    """The plan of a model of shape `args` published under `publish` (the rollout side's precision: what rollout
    computes with, and what `pretrained_tensors` writes). Built on the meta device: free whatever the model."""
    with torch.device("meta"):
        model = CausalLM(args, publish)
    names = [n for n in model.state_dict() if not (args.tie_word_embeddings and n == "lm_head.weight")]
    params = dict.fromkeys(names, "fp32")
    for prefix, module in model.named_modules():
        if isinstance(module, PrecisionLinear):
            fmt = publish.linear_format(module.name)
            block = publish.weight_block
            params[f"{prefix}.weight"] = f"{publish.fmt}[{block}x{block}]" if fmt == "fp8" else fmt
    scale_format = "ue8m0" if publish.scale_rounding == "pow2" else "fp32"
    return QuantizationPlan(source=publish.refit_source, scale_format=scale_format,
                            activation_group=publish.act_group, params=params)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file, streamed by safetensors' own writer (serializing it in memory first would double the peak
    of a real model's checkpoint). That writer reports an I/O error as a SafetensorError naming the OS error: it is
    raised as the OSError it is, so a full disk reads as one."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        if (os_error := re.search(r"\(os error (\d+)\)", str(exc))) is None:
            raise
        raise OSError(int(os_error.group(1)), f"{path}: {exc}") from exc


def write_pretrained(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                     tokenizer: Tokenizer | None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_tensors(directory / WEIGHTS, tensors, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save(directory)


def torch_device(spec: str, key: str) -> torch.device:
    """The device a config field (`key`) names; JobFailedError, which no restart can fix, when torch cannot use it."""
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise JobFailedError(f"{key} is {spec}, but this torch ({torch.__version__}) sees no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise JobFailedError(f"{key} is {spec}, but this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def load_pretrained(directory: str | Path, precision: Numerics | None = None,
                    device: torch.device | str = "cpu") -> tuple[CausalLM, Tokenizer]:
    """Load an HF-format Qwen2, Qwen3 or Llama directory (one safetensors file, or the shards its index maps;
    fp32/bf16 or block-FP8) into a CausalLM on `device`: fp32 masters, and FP8 linears keep their published e4m3
    values and scales. generation_config.json adds its eos ids (config.json then lists them all); its sampling
    settings are not read: the job's `rollout` section decides how rollout samples."""
    directory = Path(directory)
    args, hf_config = read_args(directory)
    model = CausalLM(args, precision).to(device)  # before the load: FP8 linears keep the e4m3 tensors they load
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size")
    if block is not None and list(block) != [model.precision.weight_block] * 2:
        raise ValueError(f"{directory} holds FP8 weights in {block} blocks; precision.weight_block is "
                         f"{model.precision.weight_block}")
    load_state(model, read_weights(directory))
    tokenizer = load_tokenizer(directory)
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(f"{directory}: the tokenizer has {tokenizer.vocab_size} tokens, the embedding only "
                         f"{args.vocab_size} rows")
    model.mask_ids_past(tokenizer.vocab_size)
    return model, tokenizer


def read_args(directory: Path) -> tuple[ModelArgs, dict[str, Any]]:
    """The model a directory holds, as `ModelArgs` (refusing what jetroll does not run), and its raw config.json;
    generation_config.json's eos ids join the checkpoint's."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    hf_config = json.loads(config_path.read_text())
    try:
        args = ModelArgs.from_hf(hf_config)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{config_path}: {exc}") from None
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id") or []
        extra = [i for i in (eos if isinstance(eos, list) else [eos]) if i not in args.eos_token_ids]
        args = dataclasses.replace(args, extra_eos_token_ids=(*args.extra_eos_token_ids, *extra))
    return args, hf_config


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of `model.safetensors`, or of the shards `model.safetensors.index.json` maps, each where the map
    says; a file the map does not name, a tensor it puts elsewhere or leaves out, is refused."""
    index = directory / INDEX
    files = {p.name for p in directory.glob("*.safetensors")}
    if not index.is_file():
        if files != {WEIGHTS}:
            raise FileNotFoundError(f"{directory} needs {WEIGHTS}, or an {INDEX} for its shards; it holds "
                                    f"{sorted(files) or 'no *.safetensors'}")
        return load_file(str(directory / WEIGHTS))
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    if stray := sorted(files - set(weight_map.values())):
        raise ValueError(f"{directory}: {stray} are not in {INDEX}'s weight map")
    state: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        for key, tensor in load_file(str(directory / name)).items():
            if weight_map.get(key) != name:
                raise ValueError(f"{directory / name} holds {key}, which {INDEX} puts in {weight_map.get(key)}")
            state[key] = tensor
    if missing := sorted(set(weight_map) - set(state)):
        raise ValueError(f"{directory}: {INDEX} maps {missing[:5]} to shards that do not hold them")
    return state


def load_state(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model in place (keeps parameter identity, so optimizers stay valid).

    An FP8 `weight` with its `weight_scale_inv` loads through `PrecisionLinear.load_fp8`.
    """
    if model.args.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    fp8 = [k.removesuffix(".weight_scale_inv") for k in state if k.endswith(".weight_scale_inv")]
    fp8_keys = {f"{prefix}.{name}" for prefix in fp8 for name in ("weight", "weight_scale_inv")}
    plain = {k: v for k, v in state.items() if k not in fp8_keys}  # copied into the fp32 params, cast on the way
    missing, unexpected = model.load_state_dict(plain, strict=False)
    is_tied = model.args.tie_word_embeddings
    missing = [k for k in missing if k not in fp8_keys and not (k == "lm_head.weight" and is_tied)]
    modules = dict(model.named_modules())
    unexpected += [f"{p}.weight_scale_inv" for p in fp8 if not isinstance(modules.get(p), PrecisionLinear)]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for prefix in fp8:
        linear = modules[prefix]
        assert isinstance(linear, PrecisionLinear)
        linear.load_fp8(state[f"{prefix}.weight"], state[f"{prefix}.weight_scale_inv"])
