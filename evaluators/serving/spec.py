"""What to serve and how an engine's launcher answers: :class:`ServerSpec` in, :class:`LaunchPlan` out.

An engine's launcher is a function ``plan(spec, settings, port) -> LaunchPlan`` in ``evaluators/<engine>/server.py``
(named by its line in :data:`evaluators.engines.ENGINES`). It decides the command line, the environment and
what the server will record (:class:`pipeline.serving.ServerInfo`), and gives a function that reads the
server's log once it is healthy (:class:`LogFacts`: the KV cache the engine reports, settings it confirms).
:func:`evaluators.serving.server.start_server` runs the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.serving import ServerInfo
from pipeline.specs import Engine


class ServerSpec(BaseModel):
    """One server to start: the variant's files, the engine, and the load it must take.

    ``slots`` is how many requests the server runs at once (llama-server ``--parallel``, vLLM
    ``--max-num-seqs``, the ExLlamaV2 generator's ``max_batch_size``); ``context`` the tokens one request may
    hold (prompt + output). Every launcher sizes its KV cache for ``slots`` × ``context`` so that no slot
    shares a too-small context. ``threads`` None means ``settings.threads``.

    Parallelism (recorded in :attr:`ServerInfo.parallelism`): ``tensor_parallel`` (vLLM
    ``--tensor-parallel-size``, ExLlamaV2 tensor-parallel loading), ``split_mode``/``tensor_split`` (llama.cpp
    across GPUs). Only 1 GPU-free process runs here; more needs as many GPUs.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Engine
    model: Path  # a GGUF file, or an AWQ / EXL2 folder
    slots: int = Field(default=1, ge=1)
    context: int = Field(default=2048, ge=16)  # tokens per request: prompt + output
    threads: int | None = Field(default=None, ge=1)
    tensor_parallel: int = Field(default=1, ge=1)
    split_mode: Literal["none", "layer", "row", "tensor"] | None = None  # llama.cpp --split-mode
    tensor_split: tuple[float, ...] | None = None  # llama.cpp --tensor-split, ExLlamaV2 gpu_split (GiB)
    gpu_layers: int | None = None  # llama.cpp -ngl; None: all on a GPU, none on CPU
    prompt_cache: bool = False  # llama-server cache_prompt / vLLM prefix caching: off, so TTFT is the prefill
    kv_cache_bytes: int | None = Field(default=None, ge=1)  # vLLM: None = sized from slots × context on CPU
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)  # vLLM on a GPU (its default 0.9)
    enforce_eager: bool | None = None  # vLLM: None = eager on CPU (no graphs there), CUDA graphs on a GPU
    dtype: str | None = None  # vLLM: None = the evaluator's rule (evaluators.vllm.evaluator.model_dtype)
    extra_args: tuple[str, ...] = ()  # appended to the command verbatim, and recorded
    start_timeout_s: float = Field(default=600.0, gt=0)  # launch → healthy
    stop_grace_s: float = Field(default=20.0, ge=0)  # SIGTERM → SIGKILL


@dataclass(frozen=True)
class LogFacts:
    """What a server's log says once it is healthy: the KV cache the engine allocated (bytes, tokens and the
    line it came from) and settings it confirms (merged into :attr:`ServerInfo.flags`). ``problems``: what
    contradicts the plan; :func:`~evaluators.serving.server.start_server` fails on any."""

    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_source: str | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LaunchPlan:
    """How to start one server: ``command`` (the port already in it), ``env`` (the whole environment),
    ``info`` (what the result records), ``health_path`` (200 once the model is loaded) and ``read_log`` (the
    log's text → :class:`LogFacts`)."""

    command: list[str]
    env: dict[str, str]
    info: ServerInfo
    read_log: Callable[[str], LogFacts]
    health_path: str = "/health"
    device: bool = False  # the server runs on a GPU: measure device memory too


#: An engine's launcher, as named in ``EngineInfo.server``.
Planner = Callable[[ServerSpec, Any, int], LaunchPlan]
