"""jetroll's CPU continuous-batching engine: prefill new sequences into free slots, decode all running ones.

Which slot holds which sequence is the slot table's (`slots.py`), what a sequence draws the sampler's
(`sampler.py`). Multi-turn: a sequence that samples its turn-end token is paused with its KV cache in the slot
table's paused region, and is not decoded until `resume` appends its environment's observation (prefilled after its
cached positions) or `finish` ends it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from jetroll.shared.engine.interface import ModelEngine
from jetroll.shared.engine.request import Request
from jetroll.shared.engine.sampler import choose_tokens, token_logprobs
from jetroll.shared.engine.slots import SlotTable
from jetroll.shared.model import decode_attention
from jetroll.shared.model.checkpoint import load_state
from jetroll.shared.model.model import CausalLM, KVCache
from jetroll.shared.model.precision import PACKED_MIN_ROWS
from jetroll.shared.seeds import derive_seed

RECOMPUTE_TOKENS = 8192  # padded tokens per batched KV-recompute forward on a weight swap (bounds its memory)


class Engine(ModelEngine):
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
        self.slots = SlotTable(max_batch, self.cache)
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
    def running(self) -> list[Request]:
        return self.slots.running

    @property
    def paused(self) -> list[Request]:
        return self.slots.paused

    @property
    def num_free_slots(self) -> int:
        return self.max_batch - len(self.running) - len(self.paused) - len(self.waiting)

    @property
    def has_work(self) -> bool:
        """Something to prefill, append or decode; paused sequences wait on their environments, not on the engine."""
        has_free_slot = self.slots.num_held < self.max_batch
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
        if self.waiting and self.slots.num_held < self.max_batch:
            return self._prefill()
        if self.running:
            return self._decode()
        return []

    @torch.inference_mode()
    def swap_weights(self, state: dict[str, torch.Tensor], version: int, recompute_kv: bool = True) -> None:
        """Load new weights at a token boundary; in-flight sequences continue under them, tagged `version`."""
        load_state(self.model, state)
        self.model.refresh_inference_weights()
        self.version = version
        if recompute_kv:
            held = [*enumerate(self.running), *((self.slots.paused_slot(j), r) for j, r in enumerate(self.paused))]
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
        self.resuming[request.request_id] = observation_ids

    def finish(self, request: Request, reason: str = "stop") -> None:
        """End a paused sequence (its environment is done or failed) and free its slot."""
        self.slots.take_paused(request)
        request.finish_reason = request.finish_reason or reason

    def _append(self) -> list[Request]:
        """Move each resuming sequence back to the running slots and prefill its turn end and observation."""
        finished = []
        for request in [r for r in self.paused if r.request_id in self.resuming]:
            observation = self.resuming.pop(request.request_id)
            start = request.num_tokens - 1  # the turn-end token: sampled, not yet in the cache
            slot = len(self.running)
            self.slots.take_paused(request, to_slot=slot)
            self.running.append(request)
            request.append_observation(observation, self.version)
            ids = (request.prompt_ids + request.output_ids)[start:]
            hidden = self.model.hidden(self._tensor([ids]), self._arange(start, start + len(ids)), self.cache,
                                       slot=slot)
            finished += self._sample([request], self.model.logits(hidden[:, -1]), first_slot=slot)
        return finished

    def _prefill(self) -> list[Request]:
        """Prefill waiting requests into free slots: one forward per chunk of prompts, right-padded, since an eager
        forward per group was most of the default job's rollout time; siblings sharing a prompt copy its cache."""
        free = self.max_batch - self.slots.num_held
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
        logprobs = token_logprobs(batch, logits, self.is_exact)
        tokens = self._choose(batch, logprobs)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        done, turned = [], []
        version = self.version
        for request, token, logprob in zip(batch, tokens.tolist(), chosen, strict=True):
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(version)
            # an agent's turn ends with the eos token: it pauses the sequence, unless the budget is spent
            if token in self.stop_ids and not request.ignore_eos and token != request.turn_end_id:
                request.finish_reason = "stop"
            elif len(request.output_ids) >= request.max_new_tokens or request.num_tokens >= self.max_len:
                request.finish_reason = "length"
            elif token == request.turn_end_id:
                turned.append(request)
            if request.finish_reason:
                done.append(request)
        # highest slot first: a finished sequence in the last slot is popped, not copied over a freed one
        for slot in sorted((self.running.index(request, first_slot) for request in done), reverse=True):
            self.slots.release(slot)
        for request in turned:
            self.slots.pause(self.running.index(request, first_slot))
        return done + turned

    def _choose(self, batch: list[Request], logprobs: torch.Tensor) -> torch.Tensor:
        return choose_tokens(batch, logprobs)  # a method, so a scripted engine (tests) can choose its own turns

    def _padded(self, rows: list[list[int]], width: int) -> torch.Tensor:
        """Token ids [len(rows), width], each row right-padded with 0."""
        return self._tensor([row + [0] * (width - len(row)) for row in rows])

    def _tensor(self, data: list[Any]) -> torch.Tensor:
        return torch.tensor(data, device=self.device)

    def _arange(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.device)
