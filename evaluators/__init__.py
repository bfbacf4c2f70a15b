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
}

#: Which engine evaluates each format by default.
DEFAULT_ENGINE: dict[str, str] = {
    "gguf": "llama.cpp",
    "awq": "vllm",
}

#: A second, independent engine run on the same file after the default one (see evaluators/crosscheck.py).
CROSS_CHECK_ENGINE: dict[str, str] = {
    "awq": "transformers",
}

#: A reference engine that stands in (and says so) when the default engine cannot run here.
FALLBACK_ENGINE: dict[str, str] = {
    "awq": "transformers",
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
