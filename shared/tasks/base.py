"""A task: a problem generator with a reward name and a held-out split that is disjoint by construction.

Every prompt and answer uses only the char-level vocabulary:
`0-9 + - = * / : ; , . ? ! ( ) [ ] space a-z newline`.
A problem's split (train, probe or held-out) is a pure function of its parameters (a hash), so `sample` can never
return a held-out or probe problem and neither set needs to remember what training saw. The probe set is the warm
start's: it stops the supervised pass, so it must not be the held-out set RL is scored on.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

HELDOUT_PERCENT = 10
PROBE_PERCENT = 2
Split = Literal["train", "probe", "heldout"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem: the prompt the model continues and the expected answer. A dataset row may carry chat messages
    instead (the prompt is then their last user message, for logs) and a worked solution for the warm start."""

    prompt: str
    answer: str
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs, rendered by the chat template
    solution: str | None = None


@runtime_checkable
class Task(Protocol):
    """A task users register: how to draw problems and which reward function scores them."""

    name: str
    reward: str  # name of its reward function in jetroll.functions.registry
    max_new_tokens: int  # generation budget the controller asks rollout for (capped by rollout.max_new_tokens)

    def sample(self, rng: random.Random, index: int) -> Problem:
        """A training problem (never a held-out one) for the group of admission `index` (from 1); `rng` is that
        group's own. A task drawn without replacement (a dataset) maps the index to a row."""
        ...

    def heldout(self, n: int) -> list[Problem]:
        """A deterministic held-out set of n problems, disjoint from training by construction."""
        ...

    def probe(self, n: int) -> list[Problem]:
        """A deterministic probe set of n problems for the warm start, disjoint from training and held-out sets."""
        ...

    def sft_sample(self, rng: random.Random) -> Problem:
        """A problem for the supervised warm start: training split only, may follow a curriculum."""
        ...

    def sft_completion(self, problem: Problem) -> str:
        """The target completion text for the supervised warm start (without EOS)."""
        ...


def split_of(key: str) -> Split:
    """Deterministic split, independent of any RNG: about HELDOUT_PERCENT % of problem keys are held out and
    PROBE_PERCENT % probe the warm start; the rest train."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % 100
    if bucket < HELDOUT_PERCENT:
        return "heldout"
    return "probe" if bucket < HELDOUT_PERCENT + PROBE_PERCENT else "train"


def training_problem(
    rng: random.Random, draw: Callable[[random.Random], tuple[Any, ...]], key: Callable[..., str],
    make: Callable[..., Problem],
) -> Problem:
    """Draw parameter tuples until one is in the training split."""
    while True:
        params = draw(rng)
        if split_of(key(*params)) == "train":
            return make(*params)


def split_problems(
    n: int,
    split: Split,
    draw: Callable[[random.Random], tuple[Any, ...]],
    key: Callable[..., str],
    make: Callable[..., Problem],
    seed: str,
    max_draws: int,
) -> list[Problem]:
    """Draw parameter tuples from a fixed-seed RNG, keep distinct ones of `split` until there are n."""
    if n < 0:
        raise ValueError(f"{split}(n) needs n >= 0, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[Problem] = []
    for _ in range(max_draws):
        if len(problems) == n:
            return problems
        params = draw(rng)
        k = key(*params)
        if k in seen or split_of(k) != split:
            continue
        seen.add(k)
        problems.append(make(*params))
    if len(problems) < n:
        raise ValueError(f"asked for {n} {split} problems; found {len(problems)} within the draw budget")
    return problems


class DrawnTask:
    """`sample`, `heldout`, `probe` and the warm start's defaults for a task that draws parameter tuples (`_draw`),
    names each (`key`) and makes its problem (`make`). The split sets' RNG seeds start with `splits_seed`."""

    splits_seed: ClassVar[str]

    def _draw(self, rng: random.Random) -> tuple[Any, ...]:
        raise NotImplementedError

    def key(self, *params: Any) -> str:
        raise NotImplementedError

    def make(self, *params: Any) -> Problem:
        raise NotImplementedError

    def sample(self, rng: random.Random, index: int = 0) -> Problem:
        return training_problem(rng, self._draw, self.key, self.make)

    def heldout(self, n: int) -> list[Problem]:
        return split_problems(n, "heldout", self._draw, self.key, self.make, f"{self.splits_seed}-heldout",
                              100 * n + 10_000)

    def probe(self, n: int) -> list[Problem]:
        return split_problems(n, "probe", self._draw, self.key, self.make, f"{self.splits_seed}-probe",
                              500 * n + 10_000)

    def sft_sample(self, rng: random.Random) -> Problem:
        return self.sample(rng)

    def sft_completion(self, problem: Problem) -> str:
        return problem.answer


def import_path(path: str, what: str) -> Any:
    """A user's object from `module:name` (an adapter class, an agent), or a ValueError that says which part is
    missing. Like `python -m`, the module is looked up in the current directory too (the services run where the
    job was started)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"{what} {path!r}: expected module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import {module_name}: {exc}") from None
    if not hasattr(module, name):
        raise ValueError(f"{what} {path!r}: {module_name} has no {name}")
    return getattr(module, name)
