"""Measurement aid, not part of jetroll: select vLLM's CPU block-FP8 kernel (W8A16, `fp8_scaled_mm_cpu`), which vLLM
offers only with AMX, on a CPU whose vLLM library has the op without AMX (AVX-512 with AVX512-BF16). Python imports
this file at start-up in every process of a job run as

    PYTHONPATH=scripts/force_vllm_cpu_fp8 jetroll run configs/smoke.yaml --set rollout.engine=vllm \\
        --set precision.mode=fp8_unified --set model.hidden_size=256 --set model.intermediate_size=512 ...

and patches the kernel's `is_supported` when vLLM imports its module (docs/results.md, "vLLM as the rollout engine").
"""

import importlib.abc
import importlib.util
import sys
from typing import Any

KERNELS = "vllm.model_executor.kernels.linear.scaled_mm.cpu"


class SelectCpuFp8Kernel(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != KERNELS:
            return None
        sys.meta_path.remove(self)  # find the real module, then patch it as it loads
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_select(module: Any) -> None:
            exec_module(module)
            module.CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, capability=None: (True, None))
            print("force_vllm_cpu_fp8: CPUFp8BlockScaledMMKernel selected", file=sys.stderr)

        spec.loader.exec_module = exec_and_select
        return spec


sys.meta_path.insert(0, SelectCpuFp8Kernel())
