"""The TRL side of `bench peers` prompts exactly as jetroll does: the same ids from the same draws, with and without the
model's chat template, and rewards read from either completion format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("trl")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from jetroll.bench.trl_grpo import completion_text, job_problems, trl_prompt_ids  # noqa: E402
from jetroll.shared.config.job import load_config  # noqa: E402
from jetroll.shared.model.chat import PromptFormat  # noqa: E402
from jetroll.shared.model.tokenizer import load_tokenizer  # noqa: E402
from jetroll.shared.tasks.registry import TASKS

REPO = Path(__file__).resolve().parents[3]
BPE = REPO / "configs" / "models" / "bpe-math"


def hf_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    names = json.loads((directory / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), eos_token=names["eos_token"],
                                   pad_token=names["pad_token"], chat_template=names.get("chat_template"))


@pytest.mark.parametrize("overrides", [[], ["model.chat_template=true"],
                                       ["model.chat_template=true", "model.system_prompt=Answer with a number."]])
def test_trl_prompts_are_jetroll_ids(overrides: list[str]) -> None:
    config = load_config(REPO / "configs" / "dataset_math.yaml", overrides)
    prompt_format = PromptFormat.of(config.model, load_tokenizer(BPE))
    tokenizer = hf_tokenizer(BPE)
    drawn = job_problems(config, config.build_tasks(), 24)
    assert len({problem.prompt for _, problem in drawn}) > 1 and {task for task, _ in drawn} == {"math_word"}
    for _, problem in drawn:
        prompt = problem.prompt if prompt_format.template is None else prompt_format.messages(problem)
        ids = trl_prompt_ids(tokenizer, prompt)
        assert ids == prompt_format.ids(problem)
        rendered = tokenizer.decode(ids)
        assert rendered.startswith("<|im_start|>") == config.model.chat_template
        assert ("Answer with a number." in rendered) == ("model.system_prompt=Answer with a number." in overrides)


def test_job_problems_follow_the_admission_draws() -> None:
    config = load_config(REPO / "configs" / "arithmetic.yaml", [])
    first, again = job_problems(config, config.build_tasks(), 40), job_problems(config, config.build_tasks(), 40)
    assert [p.prompt for _, p in first] == [p.prompt for _, p in again]
    other_seed = job_problems(load_config(REPO / "configs" / "arithmetic.yaml", ["seed=1"]), TASKS, 40)
    assert [p.prompt for _, p in first] != [p.prompt for _, p in other_seed]


def test_completion_text_reads_both_formats() -> None:
    assert completion_text("12+3=15.") == "12+3=15."
    assert completion_text([{"role": "assistant", "content": "12+3=15."}]) == "12+3=15."


@pytest.mark.integration  # `jetroll init-model` as a subprocess
def test_a_base_that_cannot_build_is_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """init-model's own message is the user's; the bench adds one line, not a traceback of its subprocess."""
    from jetroll.bench.peers import PeerJob, build_base
    from jetroll.shared.errors import WarmStartError

    config = tmp_path / "job.yaml"
    config.write_text((REPO / "configs" / "dataset_math.yaml").read_text().replace(
        "data/math_word.jsonl", str(tmp_path / "missing.jsonl")))
    with pytest.raises(WarmStartError, match="native: building the base failed"):
        build_base("native", tmp_path / "native", PeerJob(config, [], (0.5,)))
    assert f"dataset {tmp_path / 'missing.jsonl'}: no such file" in capfd.readouterr().err
