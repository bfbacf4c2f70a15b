"""Evaluators: one shared method (window sets, reference, metrics) and one runner per engine.

The registry of engines is the explicit dict below, of import paths so that importing this
package stays cheap (runners import ``evaluators.runners`` in foreign interpreters). To add an
engine, see evaluators/README.md.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

EVALUATORS: dict[str, str] = {
    "llama.cpp": "evaluators.llamacpp:LlamaCppEvaluator",
    "vllm": "evaluators.vllm:VLLMEvaluator",
    "transformers": "evaluators.crosscheck:TransformersCheckEvaluator",
    "exllamav2": "evaluators.exl2:ExLlamaV2Evaluator",
    "exl2-reference": "evaluators.exl2:EXL2ReferenceEvaluator",
}

#: Which engine evaluates each format by default.
DEFAULT_ENGINE: dict[str, str] = {
    "gguf": "llama.cpp",
    "awq": "vllm",
    "exl2": "exllamav2",
}

#: A second, independent engine run on the same file after the default one (see evaluators/crosscheck.py).
CROSS_CHECK_ENGINE: dict[str, str] = {
    "awq": "transformers",
}

#: The engine that stands in when the default cannot run here (labelled as such in every result).
FALLBACK_ENGINE: dict[str, str] = {
    "awq": "transformers",
    "exl2": "exl2-reference",
}


def get_evaluator(engine: str) -> Any:
    """Instantiate the evaluator registered for ``engine``.

    Raises:
        UnknownFormatError: no evaluator is registered under that name (lists the known ones).
    """
    from pipeline.errors import UnknownFormatError

    try:
        module, _, cls = EVALUATORS[engine].partition(":")
    except KeyError:
        known = ", ".join(sorted(EVALUATORS))
        raise UnknownFormatError(f"no evaluator for engine {engine!r}; known: {known}") from None
    return getattr(import_module(module), cls)()


def engine_for(fmt: str, settings: Any) -> tuple[str, str | None]:
    """The engine that evaluates ``fmt`` here, and why a fallback stands in (None when it does not)."""
    engine = DEFAULT_ENGINE[fmt]
    fallback = FALLBACK_ENGINE.get(fmt)
    if fallback is None:
        return engine, None
    reason = get_evaluator(engine).unavailable_reason(settings)
    if reason is None:
        return engine, None
    return fallback, f"{fallback} stands in for {engine}: {reason}"
