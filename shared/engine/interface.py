"""What the rollout worker drives, whichever engine decodes (jetroll's, vLLM or the timing model), and the start-up
probe every engine passes before it serves."""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from jetroll.shared.engine.request import EnvResult, Request
from jetroll.shared.errors import JobFailedError

PROBE_PROMPT_TOKENS = 16


class RolloutEngine(Protocol):
    """What the rollout worker drives: jetroll's `Engine`, `VllmEngine` and `TimingEngine`. `step` runs at most one
    token step and returns what ended; `swap_weights` runs between steps, and the tokens after it carry `version`."""

    version: int
    max_batch: int
    max_len: int
    compile_s: float
    waiting: deque[Request]
    running: list[Request]
    paused: list[Request]

    @property
    def num_free_slots(self) -> int: ...

    @property
    def has_work(self) -> bool: ...

    def add(self, requests: list[Request]) -> None: ...

    def step(self) -> list[Request]: ...

    def swap_weights(self, state: dict[str, torch.Tensor], version: int, recompute_kv: bool = True) -> None: ...

    def env_result(self, request_id: str) -> EnvResult:
        """The environment outcome the engine itself gives a finished sample (the timing model draws failures)."""


class ModelEngine:
    """What the engines that decode a model (jetroll's, vLLM's) share."""

    def generate(self: RolloutEngine, requests: list[Request]) -> list[Request]:
        """Every request run to its end."""
        self.add(requests)
        while self.has_work:
            self.step()
        return requests

    def env_result(self, request_id: str) -> EnvResult:
        """None of their own: a model's environments are the turn runner's."""
        return EnvResult()


class TurnEngine(RolloutEngine, Protocol):
    """An engine that runs multi-turn episodes: a sequence that ends a turn pauses until `resume` or `finish`."""

    def resume(self, request: Request, observation_ids: list[int]) -> None:
        """Continue a paused sequence with an observation that fits (`has_room_after`; the caller checks)."""

    def finish(self, request: Request, reason: str = "stop") -> None: ...


def probe(engine: RolloutEngine, engine_name: str) -> None:
    """A prefill of up to PROBE_PROMPT_TOKENS tokens and one decode step, greedy, before the engine reports ready. A
    kernel that loads but fails at its first forward (vLLM's CPU FP8 GEMM on AMX did) fails the job here, once, in
    one line, instead of at the first group and again after every restart. The prefill is long enough for the GEMMs'
    many-row paths (vLLM's CPU FP8 op switches to a brgemm above a few rows), the decode step takes the one-row one."""
    prompt = list(range(max(1, min(PROBE_PROMPT_TOKENS, engine.max_len - 3))))
    request = Request("start-up-probe", prompt, 2, temperature=0.0, ignore_eos=True)
    try:
        engine.add([request])
        while request.finish_reason is None:
            engine.step()
    except Exception as exc:  # any failure: the job cannot run on this engine, and no restart changes that
        raise JobFailedError(f"rollout.engine {engine_name} failed its start-up probe (a prefill and a decode step "
                             f"of the loaded model): {error_line(exc)}") from None


def error_line(exc: BaseException, limit: int = 400) -> str:
    """`TypeName: message` on one line, at most `limit` characters, without the C++ frames torch errors append."""
    lines = []
    for line in str(exc).strip().splitlines():
        if line.startswith(("Exception raised from", "frame #")):
            break
        lines.append(line.strip())
    message = " ".join(filter(None, lines))
    return f"{type(exc).__name__}: {message[:limit]}{'...' if len(message) > limit else ''}"
