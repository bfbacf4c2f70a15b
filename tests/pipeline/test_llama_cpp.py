"""The llama.cpp locator on this machine's real toolchain (the llama-cpp-python wheel in this venv and the
converter ``make setup`` extracted): the binaries it names run with its environment and are the build its
``toolchain.json`` describes; what is missing is named with the folder and what to do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.errors import ToolchainMissingError
from pipeline.llama_cpp import (
    LLAMA_CPP_VERSION,
    LlamaCppToolchain,
    llama_cpp_toolchain,
    tools_dir,
    unavailable_reason,
)
from pipeline.proc import REPO_ROOT

#: Tools Quantyard runs that answer ``--version`` (llama-quantize only prints its usage).
VERSIONED = ("llama-gguf-split", "llama-imatrix", "llama-perplexity", "llama-batched-bench")


@pytest.fixture
def tools(cache_dir: Path) -> LlamaCppToolchain:
    return llama_cpp_toolchain(Settings(cache_dir=cache_dir))


def test_the_binaries_it_names_run_and_are_the_recorded_build(tools: LlamaCppToolchain) -> None:
    commit = tools.meta()["llama_cpp_commit"]
    assert tools.commit == commit and len(commit) >= 7
    for name in VERSIONED:
        exe = tools.exe(name)
        assert exe == tools.bin_dir / name and os.access(exe, os.X_OK)
        res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env=tools.env(), timeout=60)
        assert res.returncode == 0, (name, res.stderr[-2000:])
        built = re.search(r"commit ([0-9a-f]{7,})", res.stdout + res.stderr)
        assert built and commit.startswith(built.group(1)[:7]), (name, res.stdout + res.stderr)
    res = subprocess.run([str(tools.exe("llama-quantize")), "--help"], capture_output=True, text=True,
                         env=tools.env(), timeout=60)
    assert "usage:" in res.stdout + res.stderr and "model-f32.gguf" in res.stdout + res.stderr, res.stderr[-2000:]


def test_env_puts_the_lib_dir_first_on_ld_library_path(tools: LlamaCppToolchain) -> None:
    assert tools.lib_dir == tools.bin_dir.parent / "lib"
    assert any(tools.lib_dir.glob("libllama.so*")) and any(tools.lib_dir.glob("libllama-common.so*"))
    env = tools.env()
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(tools.lib_dir)
    assert str(REPO_ROOT) in env["PYTHONPATH"].split(os.pathsep)  # workers import from the repo
    assert tools.env({"LD_LIBRARY_PATH": "/opt/x", "A": "1"}) == {
        "LD_LIBRARY_PATH": f"{tools.lib_dir}{os.pathsep}/opt/x", "A": "1"}


def test_meta_describes_the_converter_it_found(tools: LlamaCppToolchain) -> None:
    meta = tools.meta()
    assert meta["llama_cpp_python"] == tools.wheel_version == LLAMA_CPP_VERSION
    assert "LlamaForCausalLM" in meta["supported_architectures"] and meta["gguf_py"]
    assert tools.converter == tools.tools_dir / "convert_hf_to_gguf.py" and tools.converter.is_file()
    env = tools.converter_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tools.tools_dir / "gguf-py")
    res = subprocess.run([sys.executable, str(tools.converter), "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0 and "--outtype" in res.stdout, res.stderr[-2000:]
    assert unavailable_reason(Settings()) is None  # the wheel is installed


def test_tools_dir_is_the_setting_else_under_the_cache(tmp_path: Path) -> None:
    assert tools_dir(Settings(cache_dir=tmp_path, llama_cpp_tools=None)) == tmp_path / "llama.cpp" / LLAMA_CPP_VERSION
    assert tools_dir(Settings(cache_dir=tmp_path, llama_cpp_tools=tmp_path / "mine")) == tmp_path / "mine"
    assert llama_cpp_toolchain(Settings(llama_cpp_tools=tmp_path / "mine")).tools_dir == tmp_path / "mine"


def test_a_tools_dir_without_toolchain_json_is_named(tmp_path: Path, tools: LlamaCppToolchain) -> None:
    folder = tmp_path / "tools"
    folder.mkdir()
    (folder / "convert_hf_to_gguf.py").write_text("")
    half = llama_cpp_toolchain(Settings(cache_dir=tmp_path, llama_cpp_tools=folder))
    assert half.bin_dir == tools.bin_dir and half.commit is None  # an evaluation needs only the wheel
    with pytest.raises(ToolchainMissingError) as info:
        half.meta()
    text = str(info.value)
    assert f"llama.cpp converter not found in {folder}" in text
    assert "expected convert_hf_to_gguf.py and toolchain.json; found only convert_hf_to_gguf.py" in text
    assert "make setup" in (info.value.hint or "") and "QUANTYARD_LLAMA_CPP_TOOLS" in (info.value.hint or "")
    absent = llama_cpp_toolchain(Settings(cache_dir=tmp_path, llama_cpp_tools=tmp_path / "nowhere"))
    with pytest.raises(ToolchainMissingError, match=r"nowhere .*that folder does not exist"):
        absent.meta()


def test_a_missing_binary_says_what_was_expected_and_found(tmp_path: Path, tools: LlamaCppToolchain) -> None:
    with pytest.raises(ToolchainMissingError) as info:
        tools.exe("llama-nonesuch")
    text = str(info.value)
    assert f"llama.cpp tool llama-nonesuch not found in {tools.bin_dir}" in text
    assert f"llama-cpp-python {tools.wheel_version} wheel" in text and "llama-quantize" in text  # what is there
    assert "make setup" in (info.value.hint or "")
    elsewhere = LlamaCppToolchain(bin_dir=tmp_path / "bin", tools_dir=tools.tools_dir, wheel_version="0")
    with pytest.raises(ToolchainMissingError, match="that folder does not exist"):
        elsewhere.exe("llama-quantize")
