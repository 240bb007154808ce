"""The compiled decode step's attention on the CPU: `decode_attention.cpp`, built once per machine and CPU capability.

Batched matmuls read the KV cache at about half of DRAM bandwidth at decode shapes; the kernel streams each
sequence's rows once for all query heads that share them (see the .cpp). Only the compiled decode uses it: a
compiled engine already needs a C++ compiler, an eager one (docker's slim images) keeps the matmuls.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("jetroll.model")

SOURCE = Path(__file__).with_name("decode_attention.cpp")
LANES = 8  # fp32 lanes of the vector type the kernel is built for: head dims must be multiples of it


def supports(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernel runs this decode: fp32 on the CPU, head dim a multiple of LANES."""
    return (q.device.type == "cpu" and q.dtype == cache.dtype == torch.float32
            and q.shape[-1] % LANES == 0)


@functools.cache
def kernel() -> Any:
    """The built extension: compiled on first use (about 30 s, under torch's extension cache), loaded after."""
    from torch.utils.cpp_extension import load

    # AVX-512 machines run the AVX2 build too: a decode step's attention is bound by memory, not by vector width
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    flags = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for splits the sequences over torch's threads
    if avx2:
        flags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    name = f"jetroll_decode_attention_{'avx2' if avx2 else 'default'}"
    start = time.perf_counter()
    try:
        module = load(name, [str(SOURCE)], extra_cflags=flags)
    except (OSError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__  # the compiler's output is above
        raise RuntimeError(f"the CPU decode-attention kernel did not build ({reason}); compiled decode needs a C++ "
                           "compiler (g++), or set rollout.compile=false") from exc
    log.info("decode-attention kernel %s ready in %.1f s", name, time.perf_counter() - start)
    return module


# opaque to torch.compile: its graph calls the kernel between the cache update and o_proj
@torch.library.custom_op("jetroll::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v for q [n, KV, G, D] over slots 0..n-1 of caches [slots, KV, max_len, D], row i over
    positions 0..lengths[i]-1; [n, KV, G, D]."""
    return kernel().decode_attention(q, k_cache, v_cache, lengths, scale)


@decode_attention.register_fake
def _decode_attention_shape(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                            scale: float) -> torch.Tensor:
    return torch.empty_like(q)
