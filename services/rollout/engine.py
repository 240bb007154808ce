"""A CPU continuous-batching engine: prefill new sequences into free slots, decode all running ones.

Running sequences always occupy slots [0, n), so a decode step attends over a view of the cache
with no gather; a finished sequence's slot is refilled by moving the last one into it.

Multi-turn: a sequence that samples its turn-end token is paused. It keeps its KV cache in a slot at the
top of the cache (slots max_batch - 1, max_batch - 2, ...) and is not decoded until `resume` appends its
environment's observation (prefilled after its cached positions) or `finish` ends it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from jetroll.shared.config.base import JobFailedError
from jetroll.shared.model import decode_attention, exact
from jetroll.shared.model.checkpoint import load_state
from jetroll.shared.model.model import CausalLM, KVCache
from jetroll.shared.model.precision import PACKED_MIN_ROWS
from jetroll.shared.seeds import derive_seed, uniforms

RECOMPUTE_TOKENS = 8192  # padded tokens per batched KV-recompute forward on a weight swap (bounds its memory)


@dataclass(slots=True)
class Request:
    """One sample to generate. temperature == 0 means greedy."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # mu_t = log_softmax(logits / T)[token], untruncated
    versions: list[int] = field(default_factory=list)  # weight version that produced each token
    finish_reason: str | None = None
    env_status: str = "ok"  # the environment's outcome; anything else makes the reward router record env_fail
    turn_end_id: int | None = None  # multi-turn: this token ends a model turn and pauses the sequence
    observations: list[tuple[int, int]] = field(default_factory=list)  # (start, length) of env tokens in output_ids
    env_reward: float | None = None  # the environment's own reward, when it gives one
    sampling_key: int = field(default=0, init=False)  # set by Engine.add: its seed and request_id, hashed

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def loss_mask(self) -> list[int]:
        """1 per sampled token, 0 per observation token."""
        mask = [1] * len(self.output_ids)
        for start, length in self.observations:
            mask[start : start + length] = [0] * length
        return mask


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


class TurnEngine(RolloutEngine, Protocol):
    """An engine that runs multi-turn episodes: a sequence that ends a turn pauses until `resume` or `finish`."""

    def resume(self, request: Request, observation_ids: list[int]) -> None: ...

    def finish(self, request: Request, reason: str = "stop") -> None: ...


class Engine:
    """`compile=True` runs decode through torch.compile (C++ wrapper): a few graphs compiled up front,
    their wall time in `compile_s`, for a step that costs a fraction of eager's Python overhead; on the CPU its
    attention is `decode_attention`'s kernel.

    On the `exact` precision backend decode stays eager and every op takes the batch-invariant reference path, so
    each recorded log-prob is bitwise the trainer's no-grad log-prob at the same version.

    Sampling is counter-based: token i of a request is drawn from the uniform number i of a stream keyed by
    (`seed`, request_id), so a sample depends on its seed, its id and the logits it saw, never on the requests
    decoded beside it or on the process."""

    def __init__(
        self, model: CausalLM, eos_id: int, max_batch: int, max_len: int, seed: int = 0, compile: bool = False
    ) -> None:
        self.model = model.eval()
        self.stop_ids = frozenset((eos_id, *model.args.eos_token_ids))  # every eos id the checkpoint names
        self.max_batch = max_batch
        self.max_len = min(max_len, model.args.max_position_embeddings)
        self.device = model.lm_head.weight.device  # the KV cache and every tensor a step makes live beside the model
        self.is_exact = model.precision.backend == "exact"
        compiled = compile and not self.is_exact
        self.cache = KVCache(model.args, max_batch, self.max_len, self.device, attention_kernel=compiled)
        self.seed = seed
        self.version = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # running[i] lives in cache slot i
        self.paused: list[Request] = []  # paused[j] lives in cache slot max_batch - 1 - j, awaiting its environment
        self.resuming: dict[str, list[int]] = {}  # request_id -> observation ids, appended at the next step
        self.model.refresh_inference_weights()
        self.decode_fn = model.decode
        self.compile_s = 0.0
        if compiled:
            if self.device.type == "cpu":
                decode_attention.kernel()  # built (once per machine) before the compile clock starts
            # graphs are per model and cache shape; a process with a few engines (the bench) needs more than 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.decode_fn = torch.compile(model.decode, dynamic=True, fullgraph=True, options={"cpp_wrapper": True})
            self.compile_s = self._compile()

    @property
    def num_free_slots(self) -> int:
        return self.max_batch - len(self.running) - len(self.paused) - len(self.waiting)

    @property
    def has_work(self) -> bool:
        """Something to prefill, append or decode; paused sequences wait on their environments, not on the engine."""
        has_free_slot = len(self.running) + len(self.paused) < self.max_batch
        return bool(self.running or self.resuming or (self.waiting and has_free_slot))

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            if len(request.prompt_ids) >= self.max_len:
                raise ValueError(f"request {request.request_id}: prompt of {len(request.prompt_ids)} tokens "
                                 f"does not fit the context of {self.max_len}")
            request.sampling_key = derive_seed(self.seed, "sample", request.request_id)
        self.waiting.extend(requests)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Append observations, else prefill what waits (if slots are free), else decode one token; return requests
        that finished and multi-turn ones that ended a turn (finish_reason None: now paused)."""
        if self.resuming:
            return self._append()
        if self.waiting and len(self.running) + len(self.paused) < self.max_batch:
            return self._prefill()
        if self.running:
            return self._decode()
        return []

    def generate(self, requests: list[Request]) -> list[Request]:
        self.add(requests)
        while self.has_work:
            self.step()
        return requests

    @torch.inference_mode()
    def swap_weights(self, state: dict[str, torch.Tensor], version: int, recompute_kv: bool = True) -> None:
        """Load new weights at a token boundary; in-flight sequences continue under them, tagged `version`."""
        load_state(self.model, state)
        self.model.refresh_inference_weights()
        self.version = version
        if recompute_kv:
            held = [*enumerate(self.running), *((self._paused_slot(j), r) for j, r in enumerate(self.paused))]
            held.sort(key=lambda item: item[1].num_tokens)
            # batched prefills of similar lengths: a forward per sequence was most of the default job's rollout time
            while held:
                chunk = [held.pop()]
                width = chunk[0][1].num_tokens - 1
                while held and (len(chunk) + 1) * width <= RECOMPUTE_TOKENS:
                    chunk.append(held.pop())
                cached = [(request.prompt_ids + request.output_ids)[:-1] for _, request in chunk]
                slots = self._tensor([slot for slot, _ in chunk])
                self.model.hidden(self._padded(cached, width), self._arange(0, width), self.cache, slot=slots)

    def resume(self, request: Request, observation_ids: list[int]) -> None:
        """Continue a paused sequence with its environment's observation (loss_mask 0, log-prob 0, tagged with the
        version that appends it); the next step prefills it after the sequence's cached positions."""
        assert request in self.paused and request.request_id not in self.resuming
        if not has_room_after(request, observation_ids, self.max_len):
            self.finish(request, "length")
            return
        self.resuming[request.request_id] = observation_ids

    def finish(self, request: Request, reason: str = "stop") -> None:
        """End a paused sequence (its environment is done or failed) and free its slot."""
        self._take_paused(request)
        request.finish_reason = request.finish_reason or reason

    def _append(self) -> list[Request]:
        """Move each resuming sequence back to the running slots and prefill its turn end and observation."""
        finished = []
        for request in [r for r in self.paused if r.request_id in self.resuming]:
            observation = self.resuming.pop(request.request_id)
            start = request.num_tokens - 1  # the turn-end token: sampled, not yet in the cache
            slot = len(self.running)
            self._take_paused(request, to_slot=slot)
            self.running.append(request)
            request.observations.append((len(request.output_ids), len(observation)))
            request.output_ids += observation
            request.logprobs += [0.0] * len(observation)
            request.versions += [self.version] * len(observation)
            ids = (request.prompt_ids + request.output_ids)[start:]
            hidden = self.model.hidden(self._tensor([ids]), self._arange(start, start + len(ids)), self.cache,
                                       slot=slot)
            finished += self._sample([request], self.model.logits(hidden[:, -1]), first_slot=slot)
        return finished

    def _paused_slot(self, index: int) -> int:
        return self.max_batch - 1 - index

    def _take_paused(self, request: Request, to_slot: int | None = None) -> None:
        """Remove a paused sequence, keeping the paused ones contiguous at the top; copy its cache to `to_slot`."""
        index, lowest = self.paused.index(request), len(self.paused) - 1
        if index != lowest:  # swap it with the lowest paused sequence, which is the one that stays put
            self._swap_slots(self._paused_slot(index), self._paused_slot(lowest),
                             max(request.num_tokens, self.paused[lowest].num_tokens))
            self.paused[index], self.paused[lowest] = self.paused[lowest], request
        self.paused.pop()
        if to_slot is not None and to_slot != self._paused_slot(lowest):
            self.cache.copy_slot(self._paused_slot(lowest), to_slot, request.num_tokens)

    def _pause(self, slot: int) -> None:
        """Move running[slot] (it ended a turn) to the lowest free slot of the paused region, KV cache and all."""
        request, last = self.running[slot], len(self.running) - 1
        if slot != last:  # swap it with the last running sequence: the paused region may start at `last`
            self._swap_slots(slot, last, max(request.num_tokens, self.running[last].num_tokens))
            self.running[slot], self.running[last] = self.running[last], request
        self.running.pop()
        top = self._paused_slot(len(self.paused))
        if top != last:
            self.cache.copy_slot(last, top, request.num_tokens)
        self.paused.append(request)

    def _swap_slots(self, a: int, b: int, length: int) -> None:
        for k, v in zip(self.cache.k, self.cache.v, strict=True):
            k[[a, b], :, :length] = k[[b, a], :, :length]
            v[[a, b], :, :length] = v[[b, a], :, :length]

    def _prefill(self) -> list[Request]:
        """Prefill waiting requests into free slots: one forward per chunk of prompts, right-padded, since an eager
        forward per group was most of the default job's rollout time; siblings sharing a prompt copy its cache."""
        free = self.max_batch - len(self.running) - len(self.paused)
        groups: list[list[Request]] = []
        while self.waiting and free:
            group = [self.waiting.popleft()]
            while self.waiting and len(group) < free and self.waiting[0].prompt_ids == group[0].prompt_ids:
                group.append(self.waiting.popleft())
            groups.append(group)
            free -= len(group)
        finished = []
        while groups:
            chunk = [groups.pop(0)]
            width = len(chunk[0][0].prompt_ids)
            while groups and (len(chunk) + 1) * max(width, len(groups[0][0].prompt_ids)) <= RECOMPUTE_TOKENS:
                width = max(width, len(groups[0][0].prompt_ids))
                chunk.append(groups.pop(0))
            slots, last = [], []
            slot = len(self.running)
            for group in chunk:
                slots.append(slot)
                last.append(len(group[0].prompt_ids) - 1)
                slot += len(group)
            first_slot = len(self.running)
            ids = self._padded([group[0].prompt_ids for group in chunk], width)
            hidden = self.model.hidden(ids, self._arange(0, width), self.cache, slot=self._tensor(slots))
            logits = self.model.logits(hidden[self._arange(0, len(chunk)), self._tensor(last)])  # each prompt's last
            for group, start, end in zip(chunk, slots, last, strict=True):
                for i in range(1, len(group)):
                    self.cache.copy_slot(start, start + i, end + 1)
                self.running.extend(group)
            sizes = self._tensor([len(group) for group in chunk])
            batch = [request for group in chunk for request in group]
            finished += self._sample(batch, logits.repeat_interleave(sizes, dim=0), first_slot=first_slot)
        return finished

    @torch.inference_mode()
    def _compile(self) -> float:
        """Compile the decode graphs the batch sizes will hit (size 1 and the GEMM switch are specialised)."""
        start = time.perf_counter()
        for n in sorted({1, min(2, self.max_batch), min(PACKED_MIN_ROWS, self.max_batch)}):
            # writes into slots that are still free; prefill overwrites them before any read
            positions = self._arange(1, n + 1).clamp(max=self.max_len - 1)
            self.decode_fn(torch.zeros(n, 1, dtype=torch.long, device=self.device), positions, self.cache,
                           int(positions.max()) + 1)
        return time.perf_counter() - start

    def _decode(self) -> list[Request]:
        last = self._tensor([[r.output_ids[-1]] for r in self.running])
        positions = [r.num_tokens - 1 for r in self.running]
        logits = self.decode_fn(last, self._tensor(positions), self.cache, max(positions) + 1)
        return self._sample(list(self.running), logits[:, 0], first_slot=0)

    def _sample(self, batch: list[Request], logits: torch.Tensor, first_slot: int) -> list[Request]:
        if any(r.temperature not in (0.0, 1.0) for r in batch):
            logits = logits / self._tensor([r.temperature if r.temperature > 0 else 1.0 for r in batch])[:, None]
        logprobs = exact.log_softmax(logits) if self.is_exact else torch.log_softmax(logits, dim=-1)
        tokens = self._choose(batch, logprobs)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        done, turned = [], []
        version = self.version
        for request, token, logprob in zip(batch, tokens.tolist(), chosen, strict=True):
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(version)
            if token in self.stop_ids and not request.ignore_eos:
                request.finish_reason = "stop"
            elif len(request.output_ids) >= request.max_new_tokens or request.num_tokens >= self.max_len:
                request.finish_reason = "length"
            elif token == request.turn_end_id:
                turned.append(request)
            if request.finish_reason:
                done.append(request)
        # highest slot first: a finished sequence in the last slot is popped, not copied over a freed one
        for slot in sorted((self.running.index(request, first_slot) for request in done), reverse=True):
            self._release(slot)
        for request in turned:
            self._pause(self.running.index(request, first_slot))
        return done + turned

    def _choose(self, batch: list[Request], logprobs: torch.Tensor) -> torch.Tensor:
        probs = logprobs.exp()
        if any(r.top_p < 1 for r in batch):
            top_p = self._tensor([r.top_p for r in batch])
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
            probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
        keys = np.array([r.sampling_key for r in batch], dtype=np.uint64)
        counters = np.array([len(r.output_ids) for r in batch], dtype=np.uint64)
        sampled = sample_tokens(probs, torch.from_numpy(uniforms(keys, counters)).to(self.device))
        if not any(r.temperature == 0 for r in batch):
            return sampled
        greedy = self._tensor([r.temperature == 0 for r in batch])
        return torch.where(greedy, logprobs.argmax(-1), sampled)

    def _padded(self, rows: list[list[int]], width: int) -> torch.Tensor:
        """Token ids [len(rows), width], each row right-padded with 0."""
        return self._tensor([row + [0] * (width - len(row)) for row in rows])

    def _tensor(self, data: list[Any]) -> torch.Tensor:
        return torch.tensor(data, device=self.device)

    def _arange(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.device)

    def _release(self, slot: int) -> None:
        last = len(self.running) - 1
        if slot != last:
            moved = self.running[last]
            self.cache.copy_slot(last, slot, moved.num_tokens)
            self.running[slot] = moved
        self.running.pop()


def probe(engine: RolloutEngine, engine_name: str) -> None:
    """One greedy token from a two-token prompt before the engine reports ready. A kernel that loads but fails at its
    first forward (vLLM's CPU FP8 GEMM on AMX did) fails the job here, once, in one line, instead of at the first
    group and again after every restart."""
    request = Request("start-up-probe", [0, 1], 1, temperature=0.0, ignore_eos=True)
    try:
        engine.add([request])
        while request.finish_reason is None:
            engine.step()
    except Exception as exc:  # any failure: the job cannot run on this engine, and no restart changes that
        raise JobFailedError(f"rollout.engine {engine_name} failed its start-up probe (one forward of the loaded "
                             f"model): {error_line(exc)}") from None


def error_line(exc: BaseException, limit: int = 400) -> str:
    """`TypeName: message` on one line, at most `limit` characters, without the C++ frames torch errors append."""
    lines = []
    for line in str(exc).strip().splitlines():
        if line.startswith(("Exception raised from", "frame #")):
            break
        lines.append(line.strip())
    message = " ".join(filter(None, lines))
    return f"{type(exc).__name__}: {message[:limit]}{'...' if len(message) > limit else ''}"


def has_room_after(request: Request, observation_ids: list[int], max_len: int) -> bool:
    """Whether a model turn still fits after appending an observation: in the sample's budget and in the context."""
    return (len(request.output_ids) + len(observation_ids) < request.max_new_tokens
            and request.num_tokens + len(observation_ids) < max_len)


def sample_tokens(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row of `probs` [B, V] (unnormalised, >= 0), the first token whose cumulative mass
    exceeds `uniform` [B] (fp64 in [0, 1)) times the row's total. A row's token depends on that row alone."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    target = (uniform * cdf[:, -1])[:, None]
    # right=True skips zero-probability tokens; the clamp catches a target that rounds up to the total
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)
