"""The engines: one line each in :data:`ENGINES`, and how a format finds the engine that evaluates it.

Evaluators are named by import path (``evaluators.<engine>.evaluator:Class``) and imported when used, and so
are their OpenAI-compatible servers' launchers (``evaluators.<engine>.server:plan``, run by
:func:`evaluators.serving.server.start_server`).
Which engine evaluates a format, which stands in for it and which cross-checks it is the format's line in
:data:`pipeline.formats.FORMATS`. To add an engine (one package ``evaluators/<engine>/`` and one line here),
see evaluators/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any

from pipeline.errors import UnknownFormatError
from pipeline.formats import LLAMA_CPP_LOCK, Pool, format_info
from pipeline.specs import Engine


@dataclass(frozen=True)
class EngineInfo:
    """One engine: its evaluator, its server's launcher and what pins it (the stage ledger keys evaluations by
    these)."""

    engine: Engine
    evaluator: str  # "module:Class" of its Evaluator
    server: str | None = None  # "module:function" of its server launcher (evaluators.serving.spec.Planner)
    pool: Pool = "gpu"  # where its evaluations run in a distributed run, unless the recipe says otherwise
    tool_envs: tuple[str, ...] = ()  # managed tool environments (pipeline/envs.py) its runner runs in
    tool_locks: tuple[str, ...] = ()  # lock files (relative to the repository) of tools that are not envs
    #: Its evaluation is one CPU process that takes Settings.threads and holds about its files' size in memory,
    #: so several can run at once with the threads split between them (flows/schedule.py).
    cpu_shared: bool = False


ENGINES: dict[Engine, EngineInfo] = {
    Engine.LLAMA_CPP: EngineInfo(Engine.LLAMA_CPP, "evaluators.llamacpp.evaluator:LlamaCppEvaluator",
                                 server="evaluators.llamacpp.server:plan", pool="cpu", tool_locks=(LLAMA_CPP_LOCK,),
                                 cpu_shared=True),
    Engine.VLLM: EngineInfo(Engine.VLLM, "evaluators.vllm.evaluator:VLLMEvaluator",
                            server="evaluators.vllm.server:plan", tool_envs=("vllm",)),
    Engine.TRANSFORMERS: EngineInfo(Engine.TRANSFORMERS,
                                    "evaluators.transformers.evaluator:TransformersCheckEvaluator",
                                    tool_envs=("awq",)),
    Engine.EXLLAMAV2: EngineInfo(Engine.EXLLAMAV2, "evaluators.exllamav2.evaluator:ExLlamaV2Evaluator",
                                 server="evaluators.exllamav2.server:plan", tool_envs=("exl2",)),
    # the core environment's transformers and Quantyard's own codec: pinned by requirements/core.lock
    Engine.EXL2_REFERENCE: EngineInfo(Engine.EXL2_REFERENCE,
                                      "evaluators.exl2_reference.evaluator:EXL2ReferenceEvaluator", pool="cpu"),
}


def engine_info(engine: str) -> EngineInfo:
    """The table line of ``engine``.

    Raises:
        UnknownFormatError: no such engine (the message lists the known ones).
    """
    info = ENGINES.get(engine)  # type: ignore[call-overload]  # an Engine is its str value
    if info is None:
        known = ", ".join(sorted(str(e) for e in ENGINES))
        raise UnknownFormatError(f"no evaluator for engine {engine!r}; known: {known}",
                                 hint="choose one of the known engines (evaluators/README.md adds one)")
    return info


def get_evaluator(engine: str) -> Any:
    """Instantiate the evaluator of ``engine``.

    Raises:
        UnknownFormatError: no evaluator is registered under that name (lists the known ones).
    """
    module, _, cls = engine_info(engine).evaluator.partition(":")
    return getattr(import_module(module), cls)()


def engine_for(fmt: str, settings: Any) -> tuple[str, str | None]:
    """The engine that evaluates ``fmt`` here, and why a fallback stands in (None when it does not)."""
    info = format_info(fmt)
    engine = str(info.engine)
    if info.fallback_engine is None:
        return engine, None
    reason = get_evaluator(engine).unavailable_reason(settings)
    if reason is None:
        return engine, None
    fallback = str(info.fallback_engine)
    return fallback, f"{fallback} stands in for {engine}: {reason}"


def engines_of(fmt: str, cross_check: bool = True) -> list[str]:
    """The engines a run evaluates ``fmt`` on: its engine, and its cross-check engine when asked."""
    info = format_info(fmt)
    out = [str(info.engine)]
    if cross_check and info.cross_check_engine is not None:
        out.append(str(info.cross_check_engine))
    return out
