"""Dataset tasks: JSONL, Parquet and shard directories, bad rows counted and skipped, draws without replacement per
epoch as a pure function of the seed and the admission index, disjoint splits, and the config that validates it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from chat_models import QWEN_TEMPLATE, bpe_model_dir

from jetroll.functions.scoring import job_tasks
from jetroll.services.launch.run import check_datasets
from jetroll.shared.config.job import JobConfig, load_config, validate_config
from jetroll.shared.config.model import ModelConfig
from jetroll.shared.errors import ConfigError
from jetroll.shared.model.chat import PromptFormat
from jetroll.shared.model.tokenizer import load_tokenizer
from jetroll.shared.tasks.dataset import DatasetError
from jetroll.shared.tasks.registry import TaskSet
from jetroll.shared.warm_start import config_hash

REPO = Path(__file__).resolve().parents[3]


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def good_rows(n: int, start: int = 0) -> list[dict[str, str]]:
    return [{"question": f"What is {i} plus 1?", "answer": str(i + 1), "solution": f"{i}+1={i + 1}"}
            for i in range(start, start + n)]


def with_tasks(config: JobConfig) -> tuple[JobConfig, TaskSet]:
    return config, config.build_tasks()


def model_and_tasks(tree: dict[str, object]) -> tuple[ModelConfig, TaskSet]:
    config = validate_config(tree)
    return config.model, config.build_tasks()


def dataset_config(path: Path, **fields: object) -> dict[str, object]:
    entry = {"name": "words", "kind": "dataset", "path": str(path), "prompt_field": "question", "reward": "math",
             **fields}
    return {"tasks": [entry], "model": {"warm_start": {"tasks": ["words"]}}}


def test_bad_rows_are_counted_named_and_skipped(tmp_path: Path) -> None:
    rows = [*good_rows(50), "{not json", {"question": "no answer"}, {"question": 7, "answer": "1"},
            {"question": "a wrong answer type", "answer": ["1"]}, {"question": "bool", "answer": True}, [1, 2],
            {"question": "  ", "answer": "1"}, *good_rows(50, start=50)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = validate_config(dataset_config(path)).build_tasks()["words"].rows
    assert len(data.train) + len(data.probe) + len(data.heldout) == 100
    assert [(row.file, row.row) for row in data.bad] == [(str(path), line) for line in range(51, 58)]
    assert "not JSON" in str(data.bad[0]) and "no 'answer' field" in str(data.bad[1])
    assert "'question' must be a non-empty string" in str(data.bad[2])
    assert "must be a non-empty string or a number" in str(data.bad[3]) and "bool" not in str(data.bad[3])
    assert "row must be an object, got list" in str(data.bad[5])


def test_numbers_are_answers_and_a_solution_is_the_warm_start_target(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", [{"question": f"q{i}", "answer": i, "solution": f"s{i}"}
                                                 for i in range(40)])
    task = validate_config(dataset_config(path, solution_field="solution")).build_tasks()["words"]
    problem = task.sft_sample(random.Random(0))
    assert problem.answer == problem.prompt[1:] and task.sft_completion(problem) == f"s{problem.answer}"


def test_draws_are_without_replacement_per_epoch_and_a_pure_function_of_seed_and_index(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", good_rows(300))
    task = validate_config(dataset_config(path)).build_tasks()["words"]
    num = len(task.rows.train)
    rng = random.Random(0)  # a dataset ignores the group's rng: the index alone picks the row
    first = [task.sample(rng, i) for i in range(1, num + 1)]
    second = [task.sample(rng, i) for i in range(num + 1, 2 * num + 1)]
    assert sorted(p.prompt for p in first) == sorted(p.prompt for p in task.rows.train)
    assert sorted(p.prompt for p in second) == sorted(p.prompt for p in task.rows.train)
    assert [p.prompt for p in first] != [p.prompt for p in second]  # each epoch has its own order
    # a restarted controller (a new process: a new task object) continues where it was, mid-epoch
    restarted = validate_config(dataset_config(path)).tasks[0].build(0, {})
    assert [restarted.sample(rng, i) for i in (num + 7, 5, num + 1)] == [second[6], first[4], second[0]]
    other_seed = validate_config(dataset_config(path)).tasks[0].build(1, {})
    assert [other_seed.sample(rng, i) for i in range(1, num + 1)] != first


def test_splits_are_disjoint_by_prompt_and_a_heldout_file_wins(tmp_path: Path) -> None:
    rows = good_rows(1000)
    path = write_jsonl(tmp_path / "rows.jsonl", rows + rows[:100])  # duplicates share their prompt's split
    task = validate_config(dataset_config(path, heldout_fraction=0.2, probe_fraction=0.1)).build_tasks()["words"]
    data = task.rows
    train, probe, heldout = ({p.prompt for p in split} for split in (data.train, data.probe, data.heldout))
    assert not (train & probe or train & heldout or probe & heldout)
    assert 150 < len(heldout) < 250 and 50 < len(probe) < 150
    assert task.heldout(10) == data.heldout[:10]

    held_path = write_jsonl(tmp_path / "heldout.jsonl", rows[:30] + good_rows(20, start=5000))
    data = validate_config(dataset_config(path, heldout_path=str(held_path))).build_tasks()["words"].rows
    assert len(data.heldout) == 50 and data.heldout_overlap == 30 + 30  # rows[:30] twice in the training file
    assert not {p.prompt for p in data.train + data.probe} & {p.prompt for p in data.heldout}


def test_parquet_and_a_directory_of_shards(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pyarrow.Table.from_pylist(good_rows(60)), shards / "part-000.parquet")
    write_jsonl(shards / "part-001.jsonl", [*good_rows(40, start=60), {"question": "x"}])
    (shards / "README.md").write_text("not a shard")
    data = validate_config(dataset_config(shards)).build_tasks()["words"].rows
    assert [f.name for f in data.files] == ["part-000.parquet", "part-001.jsonl"]
    assert len(data.train) + len(data.probe) + len(data.heldout) == 100
    assert [(Path(r.file).name, r.row) for r in data.bad] == [("part-001.jsonl", 41)]
    (shards / "part-002.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(DatasetError, match="part-002.parquet: not a readable Parquet file"):
        _ = validate_config(dataset_config(shards)).tasks[0].build(0, {}).rows


def test_messages_rows_render_through_the_chat_template(tmp_path: Path) -> None:
    model_dir = bpe_model_dir(tmp_path / "model", QWEN_TEMPLATE)
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}?"}],
             "answer": str(i)} for i in range(40)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows + [{"messages": [{"role": "system", "content": "x"}],
                                                          "answer": "1"}])
    tree = dataset_config(path, prompt_field=None, messages_field="messages")
    with pytest.raises(ConfigError, match="messages_field needs model.chat_template: true"):
        validate_config(tree)
    config = validate_config({**tree, "model": {**tree["model"], "chat_template": True}})
    task = config.build_tasks()["words"]
    problem = task.rows.train[0]
    assert problem.prompt.startswith("What is") and problem.messages[0] == ("system", "Be brief.")
    text = PromptFormat.of(config.model, load_tokenizer(model_dir)).text(problem)
    assert text == f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{problem.prompt}<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert "has no user message" in str(task.rows.bad[0])


@pytest.mark.parametrize(("fields", "message"), [
    ({"messages_field": "messages"}, "set exactly one of prompt_field and messages_field"),
    ({"reward": "no_such_reward"}, "unknown reward 'no_such_reward'"),
    ({"heldout_fraction": 0.7, "probe_fraction": 0.3}, "must leave rows to train on"),
    ({"name": "arithmetic"}, "a built-in task has that name"),
])
def test_a_bad_dataset_entry_is_refused_with_one_line(tmp_path: Path, fields: dict[str, object],
                                                       message: str) -> None:
    with pytest.raises(ConfigError, match=message):  # a reward is checked where the job's tasks are built
        job_tasks(validate_config(dataset_config(tmp_path / "rows.jsonl", **fields)))


def test_a_short_heldout_split_is_named_before_the_job_starts(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", good_rows(300))
    config = validate_config({**dataset_config(path), "eval": {"num_problems": 100}})
    tasks = config.build_tasks()
    check_datasets(config, tasks)
    held = len(tasks["words"].rows.heldout)
    assert held < 100
    assert f"eval.num_problems is 100, but it has {held} held-out rows" in capsys.readouterr().err


def test_data_that_cannot_serve_a_job_fails_before_it_starts(tmp_path: Path) -> None:
    config = validate_config(dataset_config(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="missing.jsonl: no such file"):
        check_datasets(config, config.build_tasks())
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "no answer"}] * 5)
    with pytest.raises(DatasetError, match=r"no good training row .* \(5 bad rows; the first: .*bad.jsonl:1: no"):
        check_datasets(*with_tasks(validate_config(dataset_config(path))))
    (tmp_path / "rows.csv").write_text("question,answer\n")
    with pytest.raises(ConfigError, match="unknown format '.csv'"):
        check_datasets(*with_tasks(validate_config(dataset_config(tmp_path / "rows.csv"))))


def test_the_warm_start_cache_key_covers_the_data_and_the_tokenizer(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", good_rows(40))
    before = config_hash(*model_and_tasks(dataset_config(path)))
    write_jsonl(path, good_rows(41))
    after = config_hash(*model_and_tasks(dataset_config(path)))
    assert before != after
    model_dir = bpe_model_dir(tmp_path / "model", QWEN_TEMPLATE)
    tree = dataset_config(path)
    with_tokenizer = config_hash(*model_and_tasks({**tree, "model": {**tree["model"], "tokenizer": str(model_dir)}}))
    assert with_tokenizer != after


def test_the_shipped_dataset_config_loads_its_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # its paths are relative to the repository root, where `jetroll run` is started
    config = load_config(REPO / "configs" / "dataset_math.yaml")
    (entry,) = config.tasks
    data = config.build_tasks()[entry.name].rows
    assert not data.bad and len(data.heldout) >= config.eval.num_problems
    assert config_hash(config.model, config.build_tasks())  # its tokenizer and data are found and hashed
