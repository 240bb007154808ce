"""Seeds derived from the job's seed: every random draw of a job is a pure function of `JobConfig.seed` and a name.

`derive_seed` hashes its parts (sha256, never Python's per-process salted `hash`), so a seed depends on what a draw is
for, not on the process, the order of other draws or the batch it shares. `uniforms` is a counter-based generator:
draw `i` of key `k` needs no state, so a sequence's sampling never depends on which other sequences decode beside it.
"""

from __future__ import annotations

import hashlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment and mixing constants
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from `parts` (each part by its str): derive_seed(job_seed, "problem", index)."""
    digest = hashlib.sha256("\x1f".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Uniform draws in [0, 1) [n] (fp64, 53 bits): splitmix64's output number `counters[i]` of the stream keyed
    `keys[i]` (both uint64 [n])."""
    z = keys + (counters + np.uint64(1)) * _GOLDEN  # uint64 arithmetic wraps, as splitmix64 needs
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
