"""The timing-model engine: the rollout worker's engine seam without a model, for orchestration benchmarks.

Each sample's completion length is drawn from a lognormal with the configured mean and cv, and each slot spends
`token_time_s` per token (all slots in parallel, as a GPU decodes a batch). Time advances with the wall clock in
whole chunks of `chunk_tokens`, so the engine keeps its rate whatever the worker's own overhead; a weight swap
lands on a chunk boundary and tags the tokens after it with the new version, as in the real engine. Token ids and
log-probs are synthetic; `versions` are real.

Draws are a pure function of (seed, request_id): runs that admit the same groups see the same lengths.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from jetroll.shared.config.rollout import TimingEngineConfig
from jetroll.shared.engine.request import EnvResult, Request
from jetroll.shared.model.tokenizer import SPECIAL_TOKENS

MAX_CHUNKS_PER_STEP = 8  # a step sleeps at most this long, so the worker swaps weights and refills slots promptly


@dataclass(slots=True)
class Draw:
    """A sample's fate, fixed when it takes a slot."""

    num_tokens: int
    token_time_s: float  # slower than the engine's for a failing environment
    is_env_fail: bool
    elapsed_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.num_tokens * self.token_time_s


def draw(config: TimingEngineConfig, request_id: str) -> Draw:
    rng = np.random.default_rng([config.seed, zlib.crc32(request_id.encode())])
    sigma2 = math.log1p(config.cv**2)
    length = rng.lognormal(math.log(config.mean_tokens) - sigma2 / 2, math.sqrt(sigma2))
    is_env_fail = bool(rng.random() < config.fail_frac)
    slowdown = config.fail_slowdown if is_env_fail else 1.0
    return Draw(min(max(1, round(length)), config.max_tokens), config.token_time_s * slowdown, is_env_fail)


class TimingEngine:
    """Drop-in for `Engine` in the rollout worker: add / step / swap_weights, slots and versions alike."""

    def __init__(self, config: TimingEngineConfig, eos_id: int, vocab_size: int, max_batch: int, max_len: int) -> None:
        self.config = config
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.max_batch = max_batch
        self.max_len = max_len
        self.version = 0
        self.compile_s = 0.0
        self.chunk_s = config.chunk_tokens * config.token_time_s
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: list[Request] = []  # the engine's multi-turn seam; the timing model has no environments
        self.draws: dict[str, Draw] = {}
        self.finished: list[Request] = []
        self.env_results: dict[str, EnvResult] = {}  # the samples whose drawn environment failed
        self.clock = time.monotonic()  # the last chunk boundary

    @property
    def num_free_slots(self) -> int:
        return self.max_batch - len(self.running) - len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finished)

    def add(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)

    def step(self) -> list[Request]:
        """Advance to the chunk boundary where the next sample finishes (or a few chunks); return the finished."""
        if not self.running:
            self.clock = time.monotonic()  # idle slots: time restarts at the first boundary with work
        self._advance(time.monotonic())
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting.popleft()
            self.draws[request.request_id] = draw(self.config, request.request_id)
            self.running.append(request)
        if not self.finished and self.running:
            next_s = min(d.duration_s - d.elapsed_s for d in (self.draws[r.request_id] for r in self.running))
            num_chunks = min(max(1, math.ceil(next_s / self.chunk_s - 1e-9)), MAX_CHUNKS_PER_STEP)
            time.sleep(max(0.0, self.clock + num_chunks * self.chunk_s - time.monotonic()))
            self._advance(time.monotonic())
        finished, self.finished = self.finished, []
        return finished

    def env_result(self, request_id: str) -> EnvResult:
        """The drawn environment outcome of a finished sample: `error` for a failed one (taken: asked once)."""
        return self.env_results.pop(request_id, EnvResult())

    def swap_weights(self, state: dict[str, torch.Tensor], version: int, recompute_kv: bool = True) -> None:
        """Swap at the current chunk boundary: the chunks before it were decoded with the old version (there is no
        KV cache to recompute; the signature is the engine's)."""
        self._advance(time.monotonic())
        self.version = version

    def _advance(self, now: float) -> None:
        """Credit every running sample with the whole chunks since the last boundary, at the current version."""
        num_chunks = math.floor((now - self.clock) / self.chunk_s + 1e-9)
        if num_chunks <= 0:
            return
        elapsed_s = num_chunks * self.chunk_s
        self.clock += elapsed_s
        still_running = []
        for request in self.running:
            fate = self.draws[request.request_id]
            fate.elapsed_s += elapsed_s
            num_tokens = min(fate.num_tokens, math.floor(fate.elapsed_s / fate.token_time_s + 1e-9))
            request.versions.extend([self.version] * (num_tokens - len(request.versions)))
            if num_tokens == fate.num_tokens:
                self._finish(request, self.draws.pop(request.request_id))
            else:
                still_running.append(request)
        self.running = still_running

    def _finish(self, request: Request, fate: Draw) -> None:
        rng = np.random.default_rng([self.config.seed, zlib.crc32(request.request_id.encode()), 1])
        is_length = fate.num_tokens == self.config.max_tokens
        ids = rng.integers(len(SPECIAL_TOKENS), self.vocab_size, fate.num_tokens)
        if not is_length:
            ids[-1] = self.eos_id
        request.output_ids = ids.tolist()
        request.logprobs = (-rng.exponential(1.0, fate.num_tokens)).tolist()
        request.finish_reason = "length" if is_length else "stop"
        if fate.is_env_fail:
            self.env_results[request.request_id] = EnvResult("error")
        self.finished.append(request)
