"""A service process gives the memory of a freed weight-sized tensor back to the system."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# frees 320 MB of 8 MB tensors after a 20 MB free has raised glibc's dynamic mmap threshold above them
SCRIPT = """
import sys, torch
from jetroll.services.launch.entrypoints import prepare_process
from jetroll.shared.config.job import load_config

def rss_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) >> 10

if sys.argv[1] == "prepared":
    prepare_process("trainer", load_config("configs/smoke.yaml"))
x = torch.ones(5 << 20)
del x
before = rss_mb()
held = [torch.ones(2 << 20) for _ in range(40)]
last = held[-1]
del held
print(rss_mb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the threshold is glibc's")
@pytest.mark.integration  # a fresh interpreter's heap
def test_a_prepared_service_returns_freed_weight_sized_tensors() -> None:
    kept = {how: int(subprocess.run([sys.executable, "-c", SCRIPT, how], cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout) for how in ("prepared", "default")}
    assert kept["default"] > 200  # glibc's default keeps the freed heap: the test can see the difference
    assert kept["prepared"] < 40  # the one 8 MB tensor still held, and noise


def test_a_dropped_model_frees_its_weights_without_the_cyclic_gc() -> None:
    """The launcher builds a base and then idles for the whole job, so nothing would run the cyclic GC for it."""
    import gc
    import weakref

    from jetroll.shared.model.args import ModelArgs
    from jetroll.shared.model.model import CausalLM

    model = CausalLM(ModelArgs(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               intermediate_size=128, max_position_embeddings=64))
    model.refresh_inference_weights()
    linears = [weakref.ref(m) for m in model.modules() if hasattr(m, "inference")]
    assert linears
    gc.disable()
    try:
        del model
        assert not [ref for ref in linears if ref() is not None]
    finally:
        gc.enable()
