"""The reference: the unquantized checkpoint run by transformers over the window set.

It yields the reference perplexity and, per scored position, the top-K log-probs plus the
log of the remaining tail mass (see evaluators.metrics), stored compactly as npz. The
flow registers the file once per (source, window set, K, dtype) and reuses it for every
variant and every engine.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from evaluators.base import RunnerCommand, RunnerOutput, load_arrays, run_engine
from evaluators.metrics import perplexity
from pipeline.config import Settings
from pipeline.plan import EvalSpec
from pipeline.specs import Engine

RUNNER = "evaluators.transformers.runner"


def reference_key(window_set_id: str, spec: EvalSpec) -> str:
    """Registry key of a reference file: window set + everything that changes its numbers."""
    payload = json.dumps({"windows": window_set_id, "top_k": spec.top_k, "dtype": spec.reference_dtype,
                          "engine": "transformers"}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def run_reference(checkpoint: Path, windows: Path, out_dir: Path, spec: EvalSpec, settings: Settings,
                  python: str | None = None) -> tuple[RunnerOutput, dict[str, Any]]:
    """Run the transformers runner on the unquantized checkpoint; returns its output and a summary."""
    cmd = RunnerCommand(engine=Engine.TRANSFORMERS, python=python or settings.core_python, module=RUNNER)
    request = {"model": str(checkpoint), "windows": str(windows), "ref_topk": None, "top_k": spec.top_k,
               "threads": settings.threads, "dtype": spec.reference_dtype, "device": spec.reference_device}
    out = run_engine(cmd, request, out_dir, settings)
    assert out.arrays is not None
    arrays = load_arrays(out.arrays)
    ppl = perplexity(arrays["target_logprob"])
    summary = {**ppl.to_dict(), "top_k": spec.top_k, "dtype": spec.reference_dtype,
               "engine_version": out.result["engine_version"], "hardware": out.result["hardware"],
               "tail_mass_mean": float(__import__("numpy").exp(arrays["tail_logprob"]).mean()),
               "eval_s": out.result["quality"]["eval_s"]}
    return out, summary


def default_python() -> str:
    return sys.executable
