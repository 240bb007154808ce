"""The tiny base model: HF-format output, seeded determinism, the atomic cache, and held-out evaluation."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jetroll.functions.runner import REWARDS
from jetroll.shared import sft, warm_start
from jetroll.shared.config.model import ModelConfig, WarmStartConfig
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.errors import WarmStartError
from jetroll.shared.evaluate import evaluate
from jetroll.shared.model.checkpoint import load_pretrained
from jetroll.shared.model.tokenizer import CHARSET, SPECIAL_TOKENS, build_char_tokenizer
from jetroll.shared.tasks.base import Task
from jetroll.shared.tasks.registry import TASKS, TaskSet
from jetroll.shared.warm_start import build_base_model, config_hash, ensure_base_model

BUILTIN = TaskSet(rewards=REWARDS)  # the built-in tasks, with the rewards that score a warm start's probes


def tiny_config(cache_dir: Path | str = "~/.cache/jetroll", seed: int = 0) -> ModelConfig:
    return ModelConfig(
        cache_dir=str(cache_dir),
        hidden_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        warm_start=WarmStartConfig(max_steps=4, target_band=None, batch_size=8, lr=1e-3, seed=seed, probe_problems=50),
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("base")
    info = build_base_model(tiny_config(), BUILTIN, out_dir, progress=False)
    return out_dir, info


def test_warmstart_json_written(built: tuple[Path, dict]) -> None:
    out_dir, info = built
    saved = json.loads((out_dir / "warmstart.json").read_text())
    assert saved == info
    assert saved["steps"] == 4 and saved["seed"] == 0
    assert set(saved["accuracy"]) == {"arithmetic"}
    assert 0.0 <= saved["accuracy"]["arithmetic"] <= 1.0
    assert saved["loss"]["first"] > 0 and saved["wall_s"] > 0


def test_loads_with_load_pretrained(built: tuple[Path, dict]) -> None:
    out_dir, _ = built
    model, tokenizer = load_pretrained(out_dir)
    assert model.args.vocab_size == build_char_tokenizer().vocab_size
    assert model.args.eos_token_id == tokenizer.eos_id
    assert model.args.tie_word_embeddings and model.args.model_type == "qwen2"


def test_loads_with_transformers(built: tuple[Path, dict]) -> None:
    transformers = pytest.importorskip("transformers")
    out_dir, _ = built
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    model, tokenizer = load_pretrained(out_dir)
    ids = torch.tensor([tokenizer.encode("123+456=579")])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model.eval()(ids), atol=1e-4, rtol=1e-4)

    text = "12-345=-333\ncount 1000 by 7: 1007 1014"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"))
    assert fast.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    assert fast.decode(fast.encode(text, add_special_tokens=False)) == text
    auto = transformers.AutoTokenizer.from_pretrained(out_dir)
    assert auto.eos_token == "<eos>" and auto.eos_token_id == tokenizer.eos_id


def test_auto_tokenizer_round_trips(built: tuple[Path, dict]) -> None:
    """transformers 5 loads every qwen2 model's tokenizer as Qwen2Tokenizer, a byte-level BPE whatever the files
    say; the char tokenizer is one, so a published model encodes and decodes alike through AutoTokenizer."""
    transformers = pytest.importorskip("transformers")
    out_dir, _ = built
    _, tokenizer = load_pretrained(out_dir)
    auto = transformers.AutoTokenizer.from_pretrained(out_dir)
    text = "12-345=-333\ncount 1000 by 7: 1007 1014"
    assert auto.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    assert auto.decode(auto.encode(text, add_special_tokens=False)) == text
    assert (auto.eos_token_id, auto.pad_token_id) == (tokenizer.eos_id, tokenizer.pad_id)


def test_the_char_tokenizer_keeps_its_ids_and_refuses_what_it_lacks() -> None:
    """Its ids are the places in CHARSET they always were (a base built before it is the same model), and a character
    outside the vocabulary is an error, never silently dropped."""
    tokenizer = build_char_tokenizer()
    assert tokenizer.vocab_size == len(SPECIAL_TOKENS) + len(CHARSET)
    assert tokenizer.encode(CHARSET) == list(range(len(SPECIAL_TOKENS), tokenizer.vocab_size))
    assert tokenizer.decode(tokenizer.encode(CHARSET)) == CHARSET
    with pytest.raises(ValueError, match="the tokenizer has no token for 'BX'"):
        tokenizer.encode("aBc X")


def test_same_seed_bitwise_identical(built: tuple[Path, dict], tmp_path: Path) -> None:
    out_dir, _ = built
    build_base_model(tiny_config(), BUILTIN, tmp_path / "again", progress=False)
    first, again = load_file(str(out_dir / "model.safetensors")), load_file(str(tmp_path / "again/model.safetensors"))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)

    build_base_model(tiny_config(seed=1), BUILTIN, tmp_path / "other", progress=False)
    other = load_file(str(tmp_path / "other/model.safetensors"))
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_ensure_base_model_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(cache_dir=tmp_path / "cache")
    path = ensure_base_model(config, BUILTIN, progress=False)
    assert path == tmp_path / "cache" / f"base-{config_hash(config, BUILTIN)}"
    assert (path / "config.json").is_file() and (path / "warmstart.json").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temp dirs left behind

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(warm_start, "build_base_model", fail)
    assert ensure_base_model(config, BUILTIN, progress=False) == path
    # the cache key ignores where the cache lives and what path says, but not the weights' recipe
    assert config_hash(config, BUILTIN) == config_hash(tiny_config(cache_dir=tmp_path / "elsewhere"), BUILTIN)
    assert config_hash(config, BUILTIN) != config_hash(tiny_config(seed=1), BUILTIN)


def test_ensure_base_model_explicit_path(built: tuple[Path, dict], tmp_path: Path) -> None:
    out_dir, _ = built
    assert ensure_base_model(ModelConfig(path=str(out_dir)), BUILTIN) == out_dir
    with pytest.raises(FileNotFoundError, match="config.json"):
        ensure_base_model(ModelConfig(path=str(tmp_path)), BUILTIN)


def test_evaluate_matches_manual_count(built: tuple[Path, dict]) -> None:
    out_dir, _ = built
    model, tokenizer = load_pretrained(out_dir)
    accuracy = evaluate(model, tokenizer, BUILTIN, ["arithmetic"], num_problems=50, max_batch=16)
    assert set(accuracy) == {"arithmetic"} and 0.0 <= accuracy["arithmetic"] <= 1.0
    assert evaluate(model, tokenizer, BUILTIN, ["arithmetic"], num_problems=50, max_batch=7) == accuracy  # repeats

    task = TASKS["arithmetic"]
    problems = task.heldout(50)
    requests = [
        Request(str(i), tokenizer.encode(p.prompt), task.max_new_tokens, temperature=0.0)
        for i, p in enumerate(problems)
    ]
    Engine(model, tokenizer.eos_id, max_batch=len(requests), max_len=64).generate(requests)
    reward_fn = REWARDS[task.reward]
    num_correct = sum(
        reward_fn(tokenizer.decode(r.output_ids), p.answer).correct for r, p in zip(requests, problems, strict=True)
    )
    assert accuracy["arithmetic"] == num_correct / 50


def test_a_second_stage_starts_from_the_first_stages_cached_model(tmp_path: Path) -> None:
    """warm_start.init_from builds (and caches) the first stage, then trains on from its weights."""
    first = tiny_config(cache_dir=tmp_path / "cache")
    staged = first.model_copy(update={"warm_start": WarmStartConfig(
        max_steps=0, target_band=None, probe_problems=50, batch_size=8, seed=1, tasks=["arithmetic", "count32"],
        init_from=first.warm_start)})
    path = ensure_base_model(staged, BUILTIN, progress=False)
    first_path = tmp_path / "cache" / f"base-{config_hash(first, BUILTIN)}"
    assert first_path.is_dir() and path != first_path
    # zero further steps: the second stage's weights are exactly the first's
    ours, theirs = load_file(str(path / "model.safetensors")), load_file(str(first_path / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("field", [{"target_band": (0.3, 0.5)}, {"max_steps": 5}, {"eval_every": 7},
                                   {"probe_problems": 60}])
def test_cache_key_covers_the_band_and_the_cap(field: dict) -> None:
    config = tiny_config()
    changed = config.model_copy(update={"warm_start": config.warm_start.model_copy(update=field)})
    assert config_hash(changed, BUILTIN) != config_hash(config, BUILTIN)


def _scripted_probe(monkeypatch: pytest.MonkeyPatch, accuracy_at: Callable[[int], float]) -> list[int]:
    """Replace the probe's greedy decode by a scripted accuracy per SFT step; returns the steps it was asked at.
    The training steps stay real, so what is checked is where the pass stops and which weights it keeps."""
    asked: list[int] = []

    def probe(self: warm_start._SupervisedPass) -> float:
        asked.append(self.step)
        return accuracy_at(self.step)

    monkeypatch.setattr(warm_start._SupervisedPass, "probe_accuracy", probe)
    return asked


def banded(max_steps: int, band: tuple[float, float], eval_every: int) -> ModelConfig:
    config = tiny_config()
    return config.model_copy(update={"warm_start": config.warm_start.model_copy(update={
        "max_steps": max_steps, "target_band": band, "eval_every": eval_every})})


def test_stops_at_the_first_probe_evaluation_in_the_band(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _scripted_probe(monkeypatch, lambda step: step / 100)
    info = build_base_model(banded(100, (0.35, 0.5), eval_every=10), BUILTIN, tmp_path, progress=False)
    assert asked == [10, 20, 30, 40]
    assert info["steps"] == 40 and info["stopped"] == "in_band"
    assert info["probe_history"] == [[10, 0.1], [20, 0.2], [30, 0.3], [40, 0.4]]
    assert json.loads((tmp_path / "warmstart.json").read_text())["steps"] == 40


def test_a_jump_past_the_band_rolls_back_and_replays_the_same_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accuracy jumps past the band between two evaluations: the pass goes back to the last one and replays,
    evaluating every step; the weights it keeps are bitwise those of training straight to that step."""
    def accuracy_at(step: int) -> float:
        return 0.1 if step < 33 else 0.45 if step < 36 else 0.9

    asked = _scripted_probe(monkeypatch, accuracy_at)
    info = build_base_model(banded(100, (0.4, 0.5), eval_every=10), BUILTIN, tmp_path / "rolled", progress=False)
    assert asked == [10, 20, 30, 40, 31, 32, 33]
    assert info["steps"] == 33 and info["stopped"] == "in_band_after_rollback"
    assert info["loss"]["curve"][-1][0] <= 32  # the discarded steps' losses are gone with them

    _scripted_probe(monkeypatch, accuracy_at)
    straight = build_base_model(banded(100, (0.4, 0.5), eval_every=1), BUILTIN, tmp_path / "straight", progress=False)
    assert straight["steps"] == 33 and straight["stopped"] == "in_band"
    rolled, direct = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("rolled", "straight"))
    assert all(torch.equal(rolled[k], direct[k]) for k in direct)


@pytest.mark.parametrize(("accuracy_at", "message"), [
    (lambda step: 0.1 if step < 33 else 0.9, "jumped past target_band"),
    (lambda step: 0.2, "never reached target_band"),
])
def test_a_band_it_cannot_land_in_fails_the_build_and_caches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accuracy_at: Callable[[int], float], message: str
) -> None:
    _scripted_probe(monkeypatch, accuracy_at)
    config = banded(60, (0.4, 0.5), eval_every=10).model_copy(update={"cache_dir": str(tmp_path)})
    with pytest.raises(WarmStartError, match=message):
        ensure_base_model(config, BUILTIN, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_init_model_prints_the_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    _scripted_probe(monkeypatch, lambda step: step / 100)
    warm_start.main(banded(100, (0.35, 0.5), eval_every=10).model_copy(update={"cache_dir": str(tmp_path)}), BUILTIN)
    out = capsys.readouterr().out
    assert "warm start: 40 of at most 100 steps (stopped in target_band [35%, 50%])" in out


@pytest.mark.parametrize("band", [(0.5, 0.4), (-0.1, 0.5), (0.4, 1.2)])
def test_target_band_is_validated(band: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="target_band"):
        WarmStartConfig(target_band=band)


def test_task_weights_set_each_tasks_share_of_the_sft_rows_and_leave_uniform_bases_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[str] = []

    class Recorded(TaskSet):
        def __getitem__(self, name: str) -> Task:
            drawn.append(name)
            return super().__getitem__(name)

    tokenizer = build_char_tokenizer()
    sft.sft_batch(tokenizer, Recorded(), ["arithmetic", "count"], 400, random.Random(0),
                         task_weights={"count": 0.25})
    assert 50 <= drawn.count("count") <= 110  # 80 expected (1 in 5)
    drawn.clear()
    uniform = [random.Random(1).choice(["arithmetic", "count"])]
    sft.sft_batch(tokenizer, Recorded(), ["arithmetic", "count"], 1, random.Random(1))
    assert drawn == uniform  # no weights: the same draws as before the field existed
    config = tiny_config()
    weighted = config.model_copy(update={"warm_start": config.warm_start.model_copy(
        update={"tasks": ["arithmetic", "count"], "task_weights": {"count": 0.25}})})
    uniform_config = weighted.model_copy(update={"warm_start": weighted.warm_start.model_copy(
        update={"task_weights": {}})})
    assert config_hash(weighted, BUILTIN) != config_hash(uniform_config, BUILTIN)
    with pytest.raises(ValueError, match="task_weights: each must be > 0 and name one of tasks"):
        WarmStartConfig(tasks=["arithmetic"], task_weights={"count": 1.0})
    with pytest.raises(ValueError, match="task_weights: each must be > 0"):
        WarmStartConfig(tasks=["arithmetic"], task_weights={"arithmetic": 0.0})
