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
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from jetroll.shared.errors import ConfigError
from jetroll.shared.seeds import derive_seed
from jetroll.shared.tasks.base import Problem, Split

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


@dataclass(frozen=True)
class DatasetTask:
    """A `kind: dataset` entry of the job's `tasks` (its schema and builder: shared/config/dataset.py's
    `DatasetTaskConfig`), built into the job's TaskSet at each service's entry."""

    name: str
    path: str
    reward: str
    answer_field: str
    prompt_field: str | None = None
    messages_field: str | None = None
    solution_field: str | None = None
    heldout_path: str | None = None
    heldout_fraction: float = 0.1
    probe_fraction: float = 0.05
    max_new_tokens: int = 64
    seed: int = 0  # the job's seed: it orders the epochs
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def rows(self) -> Rows:
        """Read, validate and split every row (once per process); DatasetError when a split ends up empty."""
        files = shard_files(self.path)
        good, bad = self._read(files)
        heldout_files = shard_files(self.heldout_path) if self.heldout_path is not None else []
        splits: dict[Split, list[Problem]] = {"train": [], "probe": [], "heldout": []}
        overlap = 0
        if heldout_files:  # the file is the held-out split; the training file keeps none of its prompts
            splits["heldout"], heldout_bad = self._read(heldout_files)
            bad += heldout_bad
            held = {_key(p) for p in splits["heldout"]}
            kept = [p for p in good if _key(p) not in held]
            overlap, good = len(good) - len(kept), kept
        heldout_fraction = 0.0 if heldout_files else self.heldout_fraction
        for problem in good:
            splits[_split(problem, heldout_fraction, self.probe_fraction)].append(problem)
        train, probe, heldout = splits["train"], splits["probe"], splits["heldout"]
        for row in bad[:MAX_LOGGED_BAD_ROWS]:
            log.warning("dataset task %s: skipped bad row %s", self.name, row)
        if len(bad) > MAX_LOGGED_BAD_ROWS:
            log.warning("dataset task %s: ... and %d more bad rows", self.name, len(bad) - MAX_LOGGED_BAD_ROWS)
        if not train:
            raise DatasetError(f"dataset task {self.name}: no good training row in {self.path} ({len(bad)} bad "
                               "rows; the first: " + (str(bad[0]) if bad else "none") + ")")
        if not heldout:
            raise DatasetError(f"dataset task {self.name}: the held-out split is empty ("
                               + (f"{self.heldout_path} has no good row" if self.heldout_path
                                  else f"heldout_fraction {self.heldout_fraction} of {len(good)} rows") + ")")
        return Rows(train, probe, heldout, bad, files + heldout_files, overlap)

    def fingerprint(self) -> str:
        """sha256 of the spec and the files' bytes: what a warm start on this data depends on."""
        digest = hashlib.sha256(repr((self.path, self.answer_field, self.prompt_field, self.messages_field,
                                      self.solution_field, self.heldout_path, self.heldout_fraction,
                                      self.probe_fraction)).encode())
        for path in [*shard_files(self.path), *(shard_files(self.heldout_path) if self.heldout_path else [])]:
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
        answer = row.get(self.answer_field)
        if answer is None:
            return f"no {self.answer_field!r} field"
        if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
            return f"{self.answer_field!r} must be a non-empty string or a number, got {answer!r:.60}"
        solution = None
        if self.solution_field is not None:
            solution = row.get(self.solution_field)
            if not isinstance(solution, str) or not solution.strip():
                return f"{self.solution_field!r} must be a non-empty string, got {solution!r:.60}"
        if self.messages_field is not None:
            messages = row.get(self.messages_field)
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                return f"{self.messages_field!r} must be a non-empty list of {{role, content}} strings"
            users = [m["content"] for m in messages if m["role"] == "user"]
            if not users:
                return f"{self.messages_field!r} has no user message"
            pairs = tuple((m["role"], m["content"]) for m in messages)
            return Problem(prompt=users[-1], answer=str(answer), messages=pairs, solution=solution)
        prompt = row.get(self.prompt_field or "")
        if not isinstance(prompt, str) or not prompt.strip():
            return f"{self.prompt_field!r} must be a non-empty string, got {prompt!r:.60}"
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
