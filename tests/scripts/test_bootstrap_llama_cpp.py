"""The llama-cpp-python wheel is compiled with -march=native, so its cache key must change with the CPU's
instruction sets: a wheel built on an AVX-512 machine is never reused on an AVX2-only one, or back. It must
change with the build options too (llama-server is part of the build)."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

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


AMX = AVX512 + " amx_bf16 amx_tile amx_int8"


def test_a_cpu_with_amx_builds_without_it_unless_asked() -> None:
    """llama.cpp's AMX matmul faulted on an AMX Xeon with the pinned release (see AMX_REASON): such a CPU
    builds with -mno-amx-*, into another wheel; a CPU without AMX builds as before, under the same key."""
    mod = _script()
    assert mod.amx_choice(_cpuinfo(AVX512), {})[0] == "absent"
    assert mod.compile_flags(_cpuinfo(AVX512), {}) == ""
    choice, why = mod.amx_choice(_cpuinfo(AMX, "Intel(R) Xeon(R) Processor"), {})
    assert choice == "off" and "SIGILL" in why
    assert mod.compile_flags(_cpuinfo(AMX), {}) == mod.NO_AMX == "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert mod.amx_choice(_cpuinfo(AMX), {"QUANTYARD_LLAMA_AMX": "on"})[0] == "on"
    assert mod.compile_flags(_cpuinfo(AMX), {"QUANTYARD_LLAMA_AMX": "on"}) == ""
    assert mod.amx_choice(_cpuinfo(AMX), {"QUANTYARD_LLAMA_AMX": "off"}) == ("off", "QUANTYARD_LLAMA_AMX=off")
    with pytest.raises(SystemExit, match="auto, on or off"):
        mod.amx_choice(_cpuinfo(AMX), {"QUANTYARD_LLAMA_AMX": "maybe"})
    # Other compiler flags, another wheel; no flags, the key wheels built before this choice existed have.
    assert mod.build_key(mod.CMAKE_ARGS, mod.NO_AMX) != mod.build_key(mod.CMAKE_ARGS, "")
    legacy = hashlib.sha256(" ".join(sorted(mod.CMAKE_ARGS.split())).encode()).hexdigest()[:8]
    assert mod.build_key(mod.CMAKE_ARGS, "") == legacy


def test_the_installed_llama_cpp_was_built_as_chosen_for_this_cpu() -> None:
    """What llama.cpp itself reports it was compiled with (llama_print_system_info) matches the choice for this
    machine: no AMX kernels where the choice is off, AMX where it is on."""
    mod = _script()
    choice, _ = mod.amx_choice()
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "AVX2 = 1" in out or "NEON = 1" in out, out
    if choice == "off":
        assert "AMX_INT8 = 1" not in out, out
    elif choice == "on":
        assert "AMX_INT8 = 1" in out, out
