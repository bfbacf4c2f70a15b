"""Settings: built once at the entry point (CLI, flow) and passed down.

Library code never reads ``os.environ``; everything configurable is here, under
the ``QUANTYARD_`` prefix (``QUANTYARD_REGISTRY``, ``QUANTYARD_CACHE_DIR``...).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

LLAMA_CPP_VERSION = "0.3.36"


def _default_cache() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "quantyard"


def _default_registry() -> str:
    xdg = os.environ.get("XDG_DATA_HOME")
    return str((Path(xdg) if xdg else Path.home() / ".local" / "share") / "quantyard" / "registry")


class Settings(BaseSettings):
    """Quantyard configuration. Every field can be set as ``QUANTYARD_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="QUANTYARD_", extra="forbid", frozen=True)

    registry: str = Field(
        default_factory=_default_registry,
        description="Registry location: a folder path, or a sqlite:///... / postgresql://... URI.",
    )
    cache_dir: Path = Field(default_factory=_default_cache,
                            description="Toolchains, the demo checkpoint and hash caches.")
    work_dir: Path | None = Field(default=None,
                                  description="Intermediate files (F16 bases, staging). Default: CACHE_DIR/work")
    threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    llama_cpp_tools: Path | None = Field(
        default=None, description="Folder holding llama.cpp's convert_hf_to_gguf.py and gguf-py "
                                  "(default: CACHE_DIR/llama.cpp/<version>, filled by make setup).")
    core_python: str = Field(default=sys.executable,
                             description="Interpreter that runs the converter and llama.cpp subprocesses.")
    exl2_python: str | None = Field(default=None, description="Interpreter with ExLlamaV2 (replaces env exl2).")
    engine_timeout_s: float = Field(default=6 * 3600, gt=0)
    convert_timeout_s: float = Field(default=24 * 3600, gt=0)

    @property
    def work_root(self) -> Path:
        return self.work_dir if self.work_dir is not None else self.cache_dir / "work"

    @property
    def llama_cpp_tools_dir(self) -> Path:
        if self.llama_cpp_tools is not None:
            return self.llama_cpp_tools
        return self.cache_dir / "llama.cpp" / LLAMA_CPP_VERSION
