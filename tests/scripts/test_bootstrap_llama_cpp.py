"""The llama-cpp-python wheel is compiled with -march=native, so its cache key must change with the CPU's
instruction sets: a wheel built on an AVX-512 machine is never reused on an AVX2-only one, or back. It must
change with the build options too (llama-server is part of the build)."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import subprocess
import sys
import tarfile
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
    # a wheel with every tool (built before DROPPED_TOOLS) is another wheel
    assert mod.build_key(patches=[]) != mod.build_key()


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
    # Other compiler flags, another wheel; no flags, no CFLAGS words in the key.
    assert mod.build_key(mod.CMAKE_ARGS, mod.NO_AMX) != mod.build_key(mod.CMAKE_ARGS, "")
    plain = " ".join([*sorted(mod.CMAKE_ARGS.split()), *mod.source_patches()])
    assert mod.build_key(mod.CMAKE_ARGS, "") == hashlib.sha256(plain.encode()).hexdigest()[:8]


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


REPO = SCRIPT.parent.parent
#: The binary each tool folder of llama.cpp's tools/CMakeLists.txt builds, where it is not llama-<folder>.
BINARY = {"completion": "llama-completion", "cli": "llama-cli"}


def test_the_build_leaves_out_only_tools_no_code_runs(tmp_path: Path) -> None:
    """The pinned sdist's tools/CMakeLists.txt, patched as the build patches it: every dropped tool's
    add_subdirectory is gone, every other one is still there, and the unity-build exclusions name real files;
    no source, test, bench or script of this repository names a dropped tool's binary."""
    mod = _script()
    sdist = mod.ensure_sdist(mod.cache_root())
    prefix = f"llama_cpp_python-{mod.VERSION}/vendor/llama.cpp/"
    wanted = ("tools/", "common/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted)]
        tar.extractall(tmp_path, members=members, filter="data")
    root = tmp_path / prefix
    before = (root / "tools" / "CMakeLists.txt").read_text()
    mod.patch_source(root)
    after = (root / "tools" / "CMakeLists.txt").read_text()
    live = {line.strip() for line in after.splitlines() if line.strip().startswith("add_subdirectory(")}
    assert not {f"add_subdirectory({t})" for t in mod.DROPPED_TOOLS} & live
    kept = {"quantize", "perplexity", "imatrix", "llama-bench", "batched-bench", "gguf-split", "server", "mtmd"}
    assert {f"add_subdirectory({t})" for t in kept} <= live
    assert len(live) + len(mod.DROPPED_TOOLS) == before.count("add_subdirectory(")
    for folder, names in mod.UNITY_SKIP.items():
        line = f"set_source_files_properties({' '.join(names)} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)"
        assert line in (root / folder / "CMakeLists.txt").read_text()
    with pytest.raises(SystemExit, match="update DROPPED_TOOLS"):
        mod.patch_source(root)  # a second patch finds no add_subdirectory left to drop
    dropped = {BINARY.get(t, f"llama-{t}") for t in mod.DROPPED_TOOLS}
    here = Path(__file__).resolve()
    for path in REPO.rglob("*"):
        if path.suffix not in {".py", ".sh", ".md", ".toml"} or ".venv" in path.parts or path == here:
            continue
        text = path.read_text(errors="replace")
        for name in dropped:
            assert not re.search(rf"\b{re.escape(name)}\b(?!-)", text), (path, name)


def test_the_installed_wheel_has_every_tool_quantyard_runs() -> None:
    from pipeline.config import Settings
    from pipeline.llama_cpp import llama_cpp_toolchain

    tools = llama_cpp_toolchain(Settings())
    for name in ("llama-quantize", "llama-perplexity", "llama-imatrix", "llama-bench", "llama-batched-bench",
                 "llama-gguf-split", "llama-server"):
        exe = tools.exe(name)
        assert exe.is_file(), exe
