"""The llama-cpp-python wheel is compiled with -march=native, so its cache key must change with the CPU's
instruction sets: a wheel built on an AVX-512 machine is never reused on an AVX2-only one, or back. It must
change with the build options too (llama-server is part of the build)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bootstrap_llama_cpp.py"
AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2"
AVX512 = AVX2 + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bootstrap_llama_cpp", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpuinfo(flags: str, model: str = "AMD EPYC") -> str:
    return f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n"


def test_wheel_key_follows_the_instruction_sets() -> None:
    key = _script().cpu_key
    assert key(_cpuinfo(AVX2)) != key(_cpuinfo(AVX512))
    assert key(_cpuinfo(AVX2)) == key(_cpuinfo(" ".join(reversed(AVX2.split()))))  # the set, not the order
    assert key(_cpuinfo(AVX512, "AMD EPYC")) != key(_cpuinfo(AVX512, "Intel(R) Xeon(R) Platinum"))


def test_this_machine_key_is_the_one_of_its_cpuinfo() -> None:
    mod = _script()
    assert mod.cpu_key() == mod.cpu_key(Path("/proc/cpuinfo").read_text())


def test_wheel_key_follows_the_build_options() -> None:
    """A wheel built before llama-server was part of the build (or with other flags) is never reused."""
    mod = _script()
    assert "-DLLAMA_BUILD_SERVER=ON" in mod.CMAKE_ARGS
    assert mod.build_key() != mod.build_key("-DLLAMA_BUILD_TOOLS=ON -DLLAMA_TOOLS_INSTALL=ON -DLLAVA_BUILD=OFF")
    assert mod.build_key("-DA=1 -DB=2") == mod.build_key("-DB=2 -DA=1")  # the set, not the order
    assert mod.wheel_dir(Path("/c")).name.endswith(f"-{mod.cpu_key()}-{mod.build_key()}")
