"""Settings: built once at the entry point (CLI, flow) and passed down.

Library code never reads ``os.environ``; everything configurable is here, under
the ``QUANTYARD_`` prefix (``QUANTYARD_REGISTRY``, ``QUANTYARD_CACHE_DIR``...).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    blobs: str | None = Field(
        default=None,
        description="Blob store URL: a folder, file:///..., or any fsspec URL such as s3://bucket/prefix. "
                    "Default: the URL recorded in the registry database, else REGISTRY_FOLDER/blobs.")
    blobs_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options for the blob store, as JSON, e.g. "
                    '{"endpoint_url": "http://127.0.0.1:9000"}. Credentials may come from the usual AWS variables.')
    cache_dir: Path = Field(default_factory=_default_cache,
                            description="Toolchains, the demo checkpoint and hash caches.")
    work_dir: Path | None = Field(default=None,
                                  description="Intermediate files (F16 bases, staging). Default: CACHE_DIR/work")
    threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    eval_jobs: int = Field(default=1, ge=0,
                           description="llama.cpp evaluations an embedded run (quantyard convert) runs at once when "
                                       "no speed is measured, the threads split between them: 1 = one after another "
                                       "(the default: all at once measured no faster on 2 cores), 0 = all of them "
                                       "as far as memory allows, N = at most N (flows/schedule.py).")
    env_jobs: int = Field(default=2, ge=1, description="Tool environments `quantyard env ensure` builds at once "
                                                     "(each is its own venv and pip process).")
    llama_cpp_tools: Path | None = Field(
        default=None, description="Folder holding llama.cpp's convert_hf_to_gguf.py and gguf-py "
                                  "(default: CACHE_DIR/llama.cpp/<version>, filled by make setup).")
    core_python: str = Field(default=sys.executable,
                             description="Interpreter that runs the converter and llama.cpp subprocesses.")
    # Hugging Face Hub access uses the standard HF configuration (HF_ENDPOINT, HF_HUB_CACHE,
    # HF_HUB_OFFLINE; the token from HF_TOKEN or `hf auth login`), read here once and passed down.
    hf_endpoint: str | None = Field(default=None, validation_alias=AliasChoices("hf_endpoint", "HF_ENDPOINT"),
                                    description="Hub endpoint (default: huggingface.co).")
    hf_cache_dir: Path | None = Field(default=None, validation_alias=AliasChoices("hf_cache_dir", "HF_HUB_CACHE"),
                                      description="HF cache for hub snapshots (default: HF_HOME/hub).")
    hf_offline: bool = Field(default=False, validation_alias=AliasChoices("hf_offline", "HF_HUB_OFFLINE"),
                             description="Use only snapshots already in the HF cache.")
    # Managed tool environments (pipeline/envs.py): where they live, which accelerator to build them for,
    # and interpreters the user already has that replace a managed environment.
    envs_dir: Path | None = Field(default=None, description="Managed tool environments (default: CACHE_DIR/envs).")
    logs_dir: Path | None = Field(default=None,
                                  description="Logs of failed tool and engine subprocesses, one folder per run "
                                              "(default: CACHE_DIR/logs; the newest 50 runs of the last 14 days).")
    accelerator: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Which build of a tool environment to use; auto = cuda when nvidia-smi works.")
    awq_python: str | None = Field(default=None, description="Interpreter with llm-compressor (replaces env awq).")
    autoawq_python: str | None = Field(default=None, description="Interpreter with AutoAWQ (replaces env autoawq).")
    vllm_python: str | None = Field(default=None, description="Interpreter with vLLM (replaces env vllm).")
    exl2_python: str | None = Field(default=None, description="Interpreter with ExLlamaV2 (replaces env exl2).")
    guidellm_python: str | None = Field(default=None,
                                        description="Interpreter with GuideLLM 0.8.1 (replaces env guidellm).")
    vllm_cpu_wna16: Literal["auto", "native", "dequantized"] = Field(
        default="auto", description="vLLM on CPU, 4-bit AWQ linears: auto (vLLM's native cpu_gemm_wna16 where this "
                                    "CPU's vLLM build has it, i.e. AVX-512, in bfloat16; else an exact dequantizing "
                                    "replacement that also runs float32), native (or fail), dequantized (forced).")
    engine_timeout_s: float = Field(default=6 * 3600, gt=0)
    disk_headroom_mb: int = Field(default=64, ge=0,
                                  description="Free space kept in reserve when checking a write will fit.")
    convert_timeout_s: float = Field(default=24 * 3600, gt=0)
    memory_budget: int | None = Field(
        default=None, gt=0,
        description="Memory a run may plan to use, in bytes or as 8G / 512M (binary units). Default: what the "
                    "machine has available (MemAvailable, within any cgroup limit). The pre-flight compares every "
                    "stage's estimated peak with it before any work (flows/preflight.py).")
    web_token: SecretStr | None = Field(
        default=None, description="Bearer token for the web API's write endpoints (set an alias, change a state). "
                                  "Unset: writes through the web API are disabled (403).")
    web_cache_entries: int = Field(
        default=256, ge=0, description="Rendered pages and JSON reads the web server keeps, keyed on the registry's "
                                       "generation stamp (0: build every response afresh).")

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if isinstance(value, str):
            from pipeline.resources import parse_size

            return parse_size(value)
        return value

    @property
    def work_root(self) -> Path:
        return self.work_dir if self.work_dir is not None else self.cache_dir / "work"

    @property
    def logs_root(self) -> Path:
        return self.logs_dir if self.logs_dir is not None else self.cache_dir / "logs"

    @property
    def envs_root(self) -> Path:
        return self.envs_dir if self.envs_dir is not None else self.cache_dir / "envs"
