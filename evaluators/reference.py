"""The reference: the unquantized checkpoint run by transformers over the window set.

It yields the reference perplexity and, per scored position, the top-K log-probs plus the log of the
remaining tail mass (for the cheaper top-K lower bound) and, for the exact KL-divergence, the whole
distribution on a 16-bit grid (``evaluators.protocol.encode_rows``: 2 bytes per vocabulary entry per scored
position, plus 8 per position; 1.6 GB for 16,320 positions at a 49,152-token vocabulary, 52 GB for 100,000
positions at 262,144), an uncompressed npz member that variant runners memory-map. The flow registers the
file once per (source, window set, K, dtype, storage) and reuses it for every variant and every engine.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from evaluators.base import RunnerCommand, RunnerOutput, load_arrays, run_engine
from evaluators.metrics import perplexity
from pipeline.config import Settings
from pipeline.plan import EvalSpec
from pipeline.specs import Engine

RUNNER = "evaluators.transformers.runner"
#: How the whole distribution is stored (part of the reference's key: a new grid means a new reference).
STORE = "full-u16-r40-v1"


def reference_key(window_set_id: str, spec: EvalSpec) -> str:
    """Registry key of a reference file: window set + everything that changes its numbers."""
    payload = json.dumps({"windows": window_set_id, "top_k": spec.top_k, "dtype": spec.reference_dtype,
                          "engine": "transformers", "store": STORE if spec.kld == "exact" else "topk"},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def run_reference(checkpoint: Path, windows: Path, out_dir: Path, spec: EvalSpec, settings: Settings,
                  python: str | None = None) -> tuple[RunnerOutput, dict[str, Any]]:
    """Run the transformers runner on the unquantized checkpoint; returns its output and a summary."""
    cmd = RunnerCommand(engine=Engine.TRANSFORMERS, python=python or settings.core_python, module=RUNNER)
    request = {"model": str(checkpoint), "windows": str(windows), "reference": None, "top_k": spec.top_k,
               "threads": settings.threads, "dtype": spec.reference_dtype, "device": spec.reference_device,
               "store_full": spec.kld == "exact"}
    out = run_engine(cmd, request, out_dir, settings)
    assert out.arrays is not None
    arrays = load_arrays(out.arrays)
    ppl = perplexity(arrays["target_logprob"])
    summary = {**ppl.to_dict(), "top_k": spec.top_k, "dtype": spec.reference_dtype,
               "engine_version": out.result["engine_version"], "hardware": out.result["hardware"],
               "tail_mass_mean": float(np.exp(arrays["tail_logprob"]).mean()),
               "store": STORE if "full_step" in arrays else "topk", "file_bytes": out.arrays.stat().st_size,
               "eval_s": out.result["quality"]["eval_s"]}
    if "full_step" in arrays:
        summary["logprob_step_max"] = float(np.max(arrays["full_step"]))
    return out, summary


def default_python() -> str:
    return sys.executable
