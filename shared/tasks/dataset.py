"""A task read from a file: prompts (or chat messages) and answers in JSONL or Parquet, scored by a named reward.

Rows are drawn without replacement per epoch: group `index` (the controller's admission index, from 1) takes row
`perm_e[(index - 1) % N]` of the training rows, where epoch e = (index - 1) // N and perm_e is a permutation seeded
by the job seed, the task and e. So a draw is a pure function of the seed and the index: a restarted controller or a
resumed job continues where it was. The held-out split is a second file, or a deterministic fraction chosen by a
hash of each row's prompt (duplicates of a prompt share its split); the warm start's probe set is another such
fraction of the training file. A bad row (bad JSON, a missing field, a wrong type) is counted and skipped, naming
its file and row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from jetroll.shared.errors import ConfigError
from jetroll.shared.seeds import derive_seed
from jetroll.shared.tasks.base import Problem, Split, Task
from jetroll.shared.tasks.entry import EntryTask, TaskMixEntry

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".parquet")
MAX_LOGGED_BAD_ROWS = 20


class DatasetError(ConfigError):
    """A dataset that cannot serve a job: a missing file, an unreadable shard, or no good row in a split."""


@dataclass(frozen=True, slots=True)
class BadRow:
    file: str
    row: int  # 1-based: a JSONL line number, or a Parquet row
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.row}: {self.reason}"


@dataclass(frozen=True)
class Rows:
    """A dataset's parsed rows, split, and the rows it skipped."""

    train: list[Problem]
    probe: list[Problem]
    heldout: list[Problem]
    bad: list[BadRow]
    files: list[Path]
    heldout_overlap: int  # training-file rows dropped because their prompt is in the held-out file


class DatasetTaskConfig(TaskMixEntry):
    """A task read from a file (`kind: dataset`): prompts or chat messages, and answers, in JSONL or Parquet
    (Parquet needs the `data` extra), scored by a reward from the registry. Its task: `DatasetTask`."""

    kind: Literal["dataset"] = Field(description="marks a task read from files (the other kind: `registered`)")
    name: str = Field(min_length=1, description="the task's name in events, metrics and reward.task_backends")
    path: str = Field(min_length=1, description="a .jsonl or .parquet file, or a directory of such shards (read "
                      "in name order)")
    prompt_field: str | None = Field("prompt", description="the row's prompt text (None: use messages_field)")
    messages_field: str | None = Field(None, description="the row's chat messages, a list of {role, content}, "
                                       "rendered by the model's chat template (needs model.chat_template: true)")
    answer_field: str = Field("answer", min_length=1, description="the answer the reward scores against")
    solution_field: str | None = Field(None, description="a worked solution, the warm start's target (None: the "
                                       "answer)")
    reward: str = Field(min_length=1, description="a reward by name: math, code, exact_match, token_f1, ... or "
                        "one from reward.modules")
    heldout_path: str | None = Field(None, description="a held-out file (or directory); None: heldout_fraction "
                                     "of path's rows, chosen by a hash of the prompt")
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description="share of rows held out when heldout_path is "
                                    "None")
    probe_fraction: float = Field(0.05, ge=0, lt=1, description="share of the training file kept out of "
                                  "training as the warm start's probe set")
    max_new_tokens: int = Field(64, ge=1, description="generation budget of a completion (capped by "
                                "rollout.max_new_tokens)")

    @model_validator(mode="after")
    def _one_prompt_source(self) -> DatasetTaskConfig:
        if (self.prompt_field is None) == (self.messages_field is None):
            raise ValueError(f"dataset task {self.name}: set exactly one of prompt_field and messages_field")
        if self.heldout_path is None and self.heldout_fraction + self.probe_fraction >= 1:
            raise ValueError(f"dataset task {self.name}: heldout_fraction + probe_fraction must leave rows to train "
                             "on")
        return self

    def build(self, seed: int, known: Mapping[str, Task]) -> DatasetTask:
        """The task this entry describes, in a job of `seed` (its files are read on first use)."""
        return DatasetTask(self, seed)


@dataclass(frozen=True)
class DatasetTask(EntryTask):
    """A `kind: dataset` entry of the job's `tasks`, built into the job's TaskSet at each service's entry."""

    entry: DatasetTaskConfig
    seed: int = 0  # the job's seed: it orders the epochs
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def reward(self) -> str:
        return self.entry.reward

    @cached_property
    def rows(self) -> Rows:
        """Read, validate and split every row (once per process); DatasetError when a split ends up empty."""
        files = shard_files(self.entry.path)
        good, bad = self._read(files)
        heldout_files = shard_files(self.entry.heldout_path) if self.entry.heldout_path is not None else []
        splits: dict[Split, list[Problem]] = {"train": [], "probe": [], "heldout": []}
        overlap = 0
        if heldout_files:  # the file is the held-out split; the training file keeps none of its prompts
            splits["heldout"], heldout_bad = self._read(heldout_files)
            bad += heldout_bad
            held = {_key(p) for p in splits["heldout"]}
            kept = [p for p in good if _key(p) not in held]
            overlap, good = len(good) - len(kept), kept
        heldout_fraction = 0.0 if heldout_files else self.entry.heldout_fraction
        for problem in good:
            splits[_split(problem, heldout_fraction, self.entry.probe_fraction)].append(problem)
        train, probe, heldout = splits["train"], splits["probe"], splits["heldout"]
        for row in bad[:MAX_LOGGED_BAD_ROWS]:
            log.warning("dataset task %s: skipped bad row %s", self.name, row)
        if len(bad) > MAX_LOGGED_BAD_ROWS:
            log.warning("dataset task %s: ... and %d more bad rows", self.name, len(bad) - MAX_LOGGED_BAD_ROWS)
        if not train:
            raise DatasetError(f"dataset task {self.name}: no good training row in {self.entry.path} ({len(bad)} bad "
                               "rows; the first: " + (str(bad[0]) if bad else "none") + ")")
        if not heldout:
            raise DatasetError(f"dataset task {self.name}: the held-out split is empty ("
                               + (f"{self.entry.heldout_path} has no good row" if self.entry.heldout_path
                                  else f"heldout_fraction {self.entry.heldout_fraction} of {len(good)} rows") + ")")
        return Rows(train, probe, heldout, bad, files + heldout_files, overlap)

    def fingerprint(self) -> str:
        """sha256 of the spec and the files' bytes: what a warm start on this data depends on."""
        spec = self.entry
        digest = hashlib.sha256(repr((spec.path, spec.answer_field, spec.prompt_field, spec.messages_field,
                                      spec.solution_field, spec.heldout_path, spec.heldout_fraction,
                                      spec.probe_fraction)).encode())
        for path in [*shard_files(spec.path), *(shard_files(spec.heldout_path) if spec.heldout_path else [])]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:16]

    def sample(self, rng: random.Random, index: int) -> Problem:
        train = self.rows.train
        position = index - 1
        return train[self._permutation(position // len(train))[position % len(train)]]

    def _permutation(self, epoch: int) -> list[int]:
        if self._cache.get("epoch") != epoch:  # draws move forward an epoch at a time: keep the current one
            order = list(range(len(self.rows.train)))
            random.Random(derive_seed(self.seed, "dataset", self.name, epoch)).shuffle(order)
            self._cache.update(epoch=epoch, order=order)
        return self._cache["order"]

    def heldout(self, n: int) -> list[Problem]:
        """The first n held-out rows in file order (all of them when there are fewer)."""
        return self.rows.heldout[:n]

    def probe(self, n: int) -> list[Problem]:
        return self.rows.probe[:n]

    def sft_sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.rows.train)

    def sft_completion(self, problem: Problem) -> str:
        return problem.solution if problem.solution is not None else problem.answer

    def _read(self, files: list[Path]) -> tuple[list[Problem], list[BadRow]]:
        good: list[Problem] = []
        bad: list[BadRow] = []
        for path in files:
            for number, row in _records(path):
                problem = self._problem(row) if isinstance(row, dict) else (
                    row if isinstance(row, str) else f"a row must be an object, got {type(row).__name__}")
                if isinstance(problem, Problem):
                    good.append(problem)
                else:
                    bad.append(BadRow(str(path), number, problem))
        return good, bad

    def _problem(self, row: dict[str, Any]) -> Problem | str:
        """The row's problem, or why it is bad."""
        answer = row.get(self.entry.answer_field)
        if answer is None:
            return f"no {self.entry.answer_field!r} field"
        if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
            return f"{self.entry.answer_field!r} must be a non-empty string or a number, got {answer!r:.60}"
        solution = None
        if self.entry.solution_field is not None:
            solution = row.get(self.entry.solution_field)
            if not isinstance(solution, str) or not solution.strip():
                return f"{self.entry.solution_field!r} must be a non-empty string, got {solution!r:.60}"
        if self.entry.messages_field is not None:
            messages = row.get(self.entry.messages_field)
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                return f"{self.entry.messages_field!r} must be a non-empty list of {{role, content}} strings"
            users = [m["content"] for m in messages if m["role"] == "user"]
            if not users:
                return f"{self.entry.messages_field!r} has no user message"
            pairs = tuple((m["role"], m["content"]) for m in messages)
            return Problem(prompt=users[-1], answer=str(answer), messages=pairs, solution=solution)
        prompt = row.get(self.entry.prompt_field or "")
        if not isinstance(prompt, str) or not prompt.strip():
            return f"{self.entry.prompt_field!r} must be a non-empty string, got {prompt!r:.60}"
        return Problem(prompt=prompt, answer=str(answer), solution=solution)


def shard_files(path: str) -> list[Path]:
    """A JSONL or Parquet file, or a directory's *.jsonl and *.parquet shards in name order."""
    root = Path(path).expanduser()
    if root.is_dir():
        files = sorted(p for p in root.iterdir() if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise DatasetError(f"dataset {root}: no *.jsonl or *.parquet shard in the directory")
        return files
    if not root.is_file():
        raise DatasetError(f"dataset {root}: no such file or directory")
    if root.suffix not in SUFFIXES:
        raise DatasetError(f"dataset {root}: unknown format {root.suffix!r}; use .jsonl or .parquet")
    return [root]


def _records(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number, decoded row), or (row number, why it cannot be decoded)."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"dataset {path}: reading Parquet needs pyarrow: pip install 'jetroll[data]'") from None
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises its own error types for a corrupt or truncated file
            raise DatasetError(f"dataset {path}: not a readable Parquet file ({exc})") from None
        yield from enumerate(table.to_pylist(), start=1)
        return
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, f"not JSON ({exc.msg})"


def _key(problem: Problem) -> str:
    return json.dumps(problem.messages) if problem.messages is not None else problem.prompt


@lru_cache(maxsize=1 << 16)
def _hash_unit(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") / 2.0**64


def _split(problem: Problem, heldout_fraction: float, probe_fraction: float) -> Split:
    """Where the row falls, by a uniform number in [0, 1) fixed by its prompt."""
    bucket = _hash_unit(_key(problem))
    if bucket < heldout_fraction:
        return "heldout"
    return "probe" if bucket < heldout_fraction + probe_fraction else "train"
