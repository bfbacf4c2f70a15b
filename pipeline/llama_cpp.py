"""Where llama.cpp is: the one locator of its tool binaries, their libraries and its HF→GGUF converter.

Two pieces, both put in place by ``make setup`` (``scripts/bootstrap_llama_cpp.py``):

* the llama-cpp-python wheel installed in this interpreter's environment, built with the llama.cpp tools:
  the binaries (``llama-quantize``, ``llama-imatrix``, ``llama-gguf-split``, ``llama-perplexity``,
  ``llama-server``...) in ``site-packages/bin``, the shared libraries they load in ``site-packages/lib`` (not
  on the loader's path: :meth:`LlamaCppToolchain.env` puts them there);
* the converter taken from the same sdist: ``convert_hf_to_gguf.py``, ``gguf-py/`` and ``toolchain.json``
  (version, llama.cpp commit, supported architectures) in ``QUANTYARD_LLAMA_CPP_TOOLS``, by default
  ``CACHE_DIR/llama.cpp/<version>``.

Every converter, evaluator, CLI command, bench script and test that runs llama.cpp finds it here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.config import Settings
from pipeline.errors import ToolchainMissingError
from pipeline.proc import child_env, with_path_prefix

#: The pinned llama-cpp-python release (requirements/llama-cpp.lock; scripts/bootstrap_llama_cpp.py builds it).
LLAMA_CPP_VERSION = "0.3.36"
DISTRIBUTION = "llama_cpp_python"
CONVERTER = "convert_hf_to_gguf.py"
META = "toolchain.json"
SETUP_HINT = ("run `make setup` (it builds llama-cpp-python and extracts the converter), "
              "or set QUANTYARD_LLAMA_CPP_TOOLS")


@dataclass(frozen=True)
class LlamaCppToolchain:
    """The llama.cpp of this machine: ``bin_dir`` (the wheel's tool binaries), ``tools_dir`` (the converter and
    ``toolchain.json``) and ``wheel_version`` (the installed llama-cpp-python)."""

    bin_dir: Path
    tools_dir: Path
    wheel_version: str

    @property
    def lib_dir(self) -> Path:
        """The shared libraries the binaries load (``site-packages/lib``)."""
        return self.bin_dir.parent / "lib"

    @property
    def converter(self) -> Path:
        """llama.cpp's own HF→GGUF script."""
        return self.tools_dir / CONVERTER

    def exe(self, name: str) -> Path:
        """The path of the tool binary ``name`` (``llama-quantize``...).

        Raises ToolchainMissingError when the wheel has no such binary (built without the tools).
        """
        path = self.bin_dir / name
        if path.is_file():
            return path
        if not self.bin_dir.is_dir():
            found = "that folder does not exist"
        else:
            tools = sorted(p.name for p in self.bin_dir.iterdir() if p.name.startswith("llama-"))
            found = f"it holds {', '.join(tools)}" if tools else "it holds no llama.cpp tool"
        raise ToolchainMissingError(
            f"llama.cpp tool {name} not found in {self.bin_dir} (expected it from the llama-cpp-python "
            f"{self.wheel_version} wheel built with the llama.cpp tools; {found})",
            hint="run `make setup` (it builds llama-cpp-python with the llama.cpp tools)")

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a llama.cpp binary or a llama-cpp-python worker: ``base`` (default: ours, with the
        repo on PYTHONPATH) with :attr:`lib_dir` first on ``LD_LIBRARY_PATH``."""
        return with_path_prefix(child_env() if base is None else base, "LD_LIBRARY_PATH", self.lib_dir)

    def converter_env(self) -> dict[str, str]:
        """Environment for :attr:`converter`: the sdist's own ``gguf-py`` first on PYTHONPATH (PyPI's gguf is
        older than the script)."""
        return child_env(pythonpath=[self.tools_dir / "gguf-py", self.tools_dir])

    def meta(self) -> dict[str, Any]:
        """``toolchain.json``: ``llama_cpp_python``, ``llama_cpp_commit``, ``gguf_py``, ``sdist_sha256``,
        ``supported_architectures``.

        Raises ToolchainMissingError when the converter or ``toolchain.json`` is not in :attr:`tools_dir`.
        """
        meta = self.tools_dir / META
        if not (meta.is_file() and self.converter.is_file()):
            if not self.tools_dir.is_dir():
                found = "that folder does not exist"
            else:
                have = [n for n in (CONVERTER, META) if (self.tools_dir / n).is_file()]
                found = f"found only {have[0]}" if have else "found neither"
            raise ToolchainMissingError(
                f"llama.cpp converter not found in {self.tools_dir} (expected {CONVERTER} and {META}; {found})",
                hint=SETUP_HINT)
        return dict(json.loads(meta.read_text()))

    @property
    def commit(self) -> str | None:
        """The llama.cpp commit ``toolchain.json`` records; None when there is no ``toolchain.json`` (an
        evaluation needs only the wheel)."""
        meta = self.tools_dir / META
        return json.loads(meta.read_text()).get("llama_cpp_commit") if meta.is_file() else None


def tools_dir(settings: Settings) -> Path:
    """``QUANTYARD_LLAMA_CPP_TOOLS``, else ``CACHE_DIR/llama.cpp/<version>`` (where ``make setup`` puts it)."""
    if settings.llama_cpp_tools is not None:
        return settings.llama_cpp_tools
    return settings.cache_dir / "llama.cpp" / LLAMA_CPP_VERSION


def llama_cpp_toolchain(settings: Settings) -> LlamaCppToolchain:
    """The llama.cpp of this environment: the installed llama-cpp-python wheel and ``settings``' tools folder.
    Nothing is checked but the wheel: :meth:`LlamaCppToolchain.exe` and :meth:`LlamaCppToolchain.meta` say
    what is missing when it is used.

    Raises ToolchainMissingError when llama-cpp-python is not installed.
    """
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise ToolchainMissingError("llama-cpp-python is not installed in this environment",
                                    hint="run `make setup`") from exc
    return LlamaCppToolchain(bin_dir=Path(str(dist.locate_file("bin"))), tools_dir=tools_dir(settings),
                             wheel_version=dist.version)


def unavailable_reason(settings: Settings) -> str | None:
    """None when llama.cpp can run here (the wheel is installed), else why not (for listings and errors)."""
    try:
        llama_cpp_toolchain(settings)
    except ToolchainMissingError as exc:
        return f"{exc.message} ({exc.hint})"
    return None
