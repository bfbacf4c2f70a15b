"""What this CPU can do, for choosing and recording code paths (standard library only: engine runners and
workers in other interpreters import it too).

Machines of one kind differ: some x86-64 CPUs are AVX2-only, others have AVX-512 with or without native
bfloat16 (``avx512_bf16``, AMX). Engines pick different kernels on each (llama.cpp's ``-march=native``
build, vLLM's ``_C_AVX2`` / ``_C_AVX512`` / ``_C`` builds), and torch computes bfloat16 several times more
slowly where the CPU has no bfloat16 instructions (measured here: a 1024×576×1536 matmul 7× slower than
in float32 on an AVX2-only EPYC). Every result records :func:`cpu_flags`.
"""

from __future__ import annotations

from pathlib import Path

#: The instruction-set flags that decide which kernels run (a subset of /proc/cpuinfo's, in this order).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "asimd", "sve", "bf16")


def cpu_flags(cpuinfo: str | None = None) -> str:
    """The :data:`ISA_FLAGS` this CPU has, space-separated ('' when /proc/cpuinfo is unreadable).
    ``cpuinfo``: the text of /proc/cpuinfo (read when None)."""
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.split(":", 1)[1].split())
            return " ".join(f for f in ISA_FLAGS if f in have)
    return ""


def native_bf16(flags: str | None = None) -> bool:
    """Whether the CPU computes bfloat16 natively (AVX-512 BF16, AMX, or Arm's BF16 extension)."""
    have = set((cpu_flags() if flags is None else flags).split())
    return bool(have & {"avx512_bf16", "amx_bf16", "bf16"})


def cpu_compute_dtype(checkpoint_dtype: str | None, flags: str | None = None) -> str:
    """The dtype to calibrate a checkpoint in on this CPU: bfloat16 checkpoints in bfloat16 where the CPU
    has it natively, everything else in float32 (float16 has no fast CPU path at all)."""
    if checkpoint_dtype == "bfloat16" and native_bf16(flags):
        return "bfloat16"
    return "float32"
