"""llama.cpp runner (llama-cpp-python): log-probs on the shared windows, then speed.

Quality: each window is evaluated as one batch; llama.cpp returns the logits of the scored
positions only, and they feed the shared Collector.

Speed (when asked), all on llama-cpp-python's low-level API in this process, timestamps only, every metric
computed by ``evaluators/speed.py`` (its docstring has the definitions):

* batch 1, on a one-sequence context (as llama-bench's): the ``prompt_tokens`` prompt decoded as one batch
  (logits of its last row only), then ``gen_tokens − 1`` greedy decode steps: time to first token, prompt
  tok/s, decode tok/s at depth ``prompt_tokens``;
* N concurrent sequences for each N in ``parallel``, on one context of ``max(parallel)`` sequences with a
  per-sequence KV cache (as llama-batched-bench's): N different ``parallel_prompt_tokens`` prompts prefilled
  together in batches of ``n_batch`` tokens (logits of each prompt's last row), then ``parallel_gen_tokens −
  1`` decode steps of N tokens: aggregate generated tok/s, end to end.

Each is repeated ``repeats`` times. llama-bench and llama-batched-bench of the same build are the reference
tools these are checked against (tests/evaluators/test_speed_crosscheck.py, bench/speed_crosscheck.py), not
what is measured here. The result records the shape and the engine settings (threads, n_ctx, n_batch,
n_ubatch, KV cache types, flash attention, the CPU backend's features).
"""

from __future__ import annotations

import ctypes
import re
import time
from concurrent.futures import ThreadPoolExecutor
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
from pipeline.llama_load import load_model

FLASH_ATTN = {"auto": -1, "on": 1, "off": 0}  # llama_flash_attn_type; llama.cpp's own tools default to auto


class _Engine:
    """One model and context on llama-cpp-python's low-level bindings, one sequence, with a batch whose
    per-token logits flags we set (``Llama.eval`` asks for all rows or only the last). Flash attention is
    ``auto`` unless the request says otherwise, as in llama.cpp's own tools (llama-perplexity, llama-bench).
    ``n_seq`` sequences (speed at N concurrent sequences) get a KV cache each (``kv_unified`` off, as in
    llama-batched-bench); ``n_ubatch`` defaults to ``n_batch``."""

    def __init__(self, req: dict[str, Any], n_ctx: int, n_batch: int, n_seq: int = 1,
                 n_ubatch: int | None = None) -> None:
        import llama_cpp
        from llama_cpp import _internals
        from llama_cpp._utils import suppress_stdout_stderr

        self.flash_attn = str(req.get("flash_attn", "auto"))
        if self.flash_attn not in FLASH_ATTN:
            raise SystemExit(f"flash_attn must be one of {sorted(FLASH_ATTN)}, got {self.flash_attn!r}")
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = int(req.get("n_gpu_layers", 0))
        self.model = load_model(llama_cpp, _internals, req["model"], mparams)  # LlamaLoadError: llama.cpp's reason
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch if n_ubatch is None else n_ubatch
        cparams.n_seq_max = n_seq
        cparams.kv_unified = False
        cparams.n_threads = cparams.n_threads_batch = int(req["threads"])
        cparams.flash_attn_type = FLASH_ATTN[self.flash_attn]
        with suppress_stdout_stderr(disable=False):
            self.ctx = _internals.LlamaContext(model=self.model, params=cparams, verbose=False)
        self.n_vocab = self.model.n_vocab()
        self.batch = _internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)
        b = self.batch.batch
        self.tokens = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self.flags = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))[:] = 1
        for i in range(n_batch):
            b.seq_id[i][0] = 0
        self.seq_ids = np.zeros(n_batch, np.int64)  # what b.seq_id[i][0] holds
        self.type_kv = (int(cparams.type_k), int(cparams.type_v))

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.ctx.memory, True)

    def decode(self, tokens: np.ndarray | list[int], pos0: int, first_row: int,
               end_row: int | None = None) -> np.ndarray:
        """Decode ``tokens`` at positions ``pos0...``; returns a view of the logits of rows
        ``first_row..end_row`` (default: to the last), valid until the next decode."""
        n = len(tokens)
        end = n if end_row is None else end_row
        self.tokens[:n] = tokens
        self.pos[:n] = np.arange(pos0, pos0 + n)
        self.flags[:n] = 0
        self.flags[first_row:end] = 1
        self.batch.batch.n_tokens = n
        rc = self.lib.llama_decode(self.ctx.ctx, self.batch.batch)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc} for {n} tokens at position {pos0}")
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx.ctx), shape=(end - first_row, self.n_vocab))

    def decode_seqs(self, tokens: np.ndarray, pos: np.ndarray, seqs: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """Decode ``tokens`` at positions ``pos`` of sequences ``seqs``; returns a view of the logits of the
        rows where ``flags`` is set, in batch order, valid until the next decode. Only sequence ids that
        differ from the previous batch's are written (a ctypes store per token)."""
        n = len(tokens)
        self.tokens[:n] = tokens
        self.pos[:n] = pos
        self.flags[:n] = flags
        for i in np.flatnonzero(self.seq_ids[:n] != seqs):
            self.batch.batch.seq_id[i][0] = int(seqs[i])
        self.seq_ids[:n] = seqs
        self.batch.batch.n_tokens = n
        rc = self.lib.llama_decode(self.ctx.ctx, self.batch.batch)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc} for {n} tokens of sequences {sorted(set(seqs.tolist()))}")
        rows = int(np.count_nonzero(flags))
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx.ctx), shape=(rows, self.n_vocab))

    def settings(self, req: dict[str, Any]) -> dict[str, Any]:
        """The engine settings a speed result records (evaluators.speed.engine_settings)."""
        lib, ctx = self.lib, self.ctx.ctx
        buf = (ctypes.c_char * 256)()
        lib.llama_model_desc(self.model.model, buf, len(buf))
        gpu = int(req.get("n_gpu_layers", 0))
        types = {getattr(lib, n): n.removeprefix("GGML_TYPE_").lower() for n in dir(lib) if n.startswith("GGML_TYPE_")}
        kv = {"n_ctx": lib.llama_n_ctx(ctx), "n_ctx_seq": lib.llama_n_ctx_seq(ctx), "n_batch": lib.llama_n_batch(ctx),
              "n_ubatch": lib.llama_n_ubatch(ctx), "n_seq_max": lib.llama_n_seq_max(ctx), "kv_unified": False,
              "type_k": types.get(self.type_kv[0], self.type_kv[0]),
              "type_v": types.get(self.type_kv[1], self.type_kv[1]), "flash_attn": self.flash_attn}
        return engine_settings(dtype=f"GGUF weights: {buf.value.decode(errors='replace')}; activations f32",
                               kernel=f"ggml ({lib.llama_print_system_info().decode(errors='replace').strip()})",
                               cuda_graphs="n/a (CPU)" if gpu == 0 else "ggml CUDA backend default",
                               kv_cache=kv, threads={"n_threads": lib.llama_n_threads(ctx),
                                                     "n_threads_batch": lib.llama_n_threads_batch(ctx)},
                               n_gpu_layers=gpu)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()


def _quality(req: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Score every window as one batch, asking llama.cpp for the logits of the scored rows only.

    Row ``i`` of a window predicts its token ``i+1``, so a window scored from target ``s`` needs the
    rows ``s-1 .. W-2`` (the last row predicts nothing): the batch flags exactly those, as
    ``llama-perplexity`` flags the second half of its chunks, so llama.cpp computes the output layer and
    copies logits for nothing else.
    """
    ids, starts = load_windows(req["windows"])
    n_windows, window = ids.shape
    eng = _Engine(req, n_ctx=window, n_batch=window)
    col = Collector.from_request(req)
    eng.decode(ids[0, :2], 0, 1)  # warm-up (threads, weights paged in), as llama.cpp's tools do before timing
    # Decode a window on all threads, then score its rows on all threads (blocks of rows in parallel, numpy
    # releases the GIL), straight from llama.cpp's buffer. Overlapping the two instead oversubscribes the
    # cores: measured on 2 cores, 0.963 of llama-perplexity's throughput overlapped vs 0.981 in turn.
    with Timer() as t, ThreadPoolExecutor(max_workers=max(1, int(req["threads"]))) as pool:
        for k in range(n_windows):
            start = int(starts[k])
            eng.clear()
            col.add_rows(eng.decode(ids[k], 0, start - 1, window - 1), ids[k, start:], pool)
            report_progress("windows", k + 1, n_windows, (k + 1) * window)
    n = col.save(out_dir)
    eng.close()
    return {"n_positions": n, "eval_s": t.s, "eval_tok_per_s": ids.size / t.s, "n_vocab": eng.n_vocab,
            "flash_attn": eng.flash_attn}


def _single_stream(req: dict[str, Any], prompt: list[int], gen: int,
                   repeats: int) -> tuple[list[Seq], dict[str, Any]]:
    """Batch 1, ``repeats`` times: the prompt as one batch (logits of its last row only) gives the first token,
    then ``gen − 1`` greedy decode steps. Returns the runs' timestamps and the engine settings."""
    p = len(prompt)
    eng = _Engine(req, n_ctx=p + gen + 8, n_batch=p)
    eng.decode(prompt[:16], 0, 15)  # warm-up: page in weights, build graphs (llama-bench warms up too)
    runs = []
    for _ in range(repeats):
        eng.clear()
        t_submit = time.perf_counter()
        tok = int(np.argmax(eng.decode(prompt, 0, p - 1)[0]))
        t_first = time.perf_counter()
        for i in range(gen - 1):
            tok = int(np.argmax(eng.decode([tok], p + i, 0)[0]))
        runs.append(Seq(t_submit, t_first, time.perf_counter(), p, gen))
    settings = eng.settings(req)
    eng.close()
    return runs, settings


#: The logical and physical batch sizes of the concurrent runs, as llama-batched-bench's defaults (-b, -ub).
PARALLEL_BATCH, PARALLEL_UBATCH = 2048, 512


def parallel_context(n_max: int, prompt_tokens: int, gen_tokens: int) -> dict[str, int]:
    """The context of the concurrent runs: ``n_ctx``, ``n_batch``, ``n_ubatch`` (llama.cpp caps the batch at
    the context). The cross-check runs llama-batched-bench with the same ``-c``, ``-b`` and ``-ub``."""
    n_ctx = n_max * (prompt_tokens + gen_tokens) + 64
    n_batch = min(PARALLEL_BATCH, n_ctx)
    return {"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": min(PARALLEL_UBATCH, n_batch)}


def _concurrent_run(eng: _Engine, batch: int, prompts_: list[list[int]], gen: int) -> list[Seq]:
    """One run of N sequences submitted together: their prompts prefilled in batches of ``batch`` tokens, each
    sequence's first token taken when the batch holding its last prompt token is decoded, then ``gen − 1``
    decode steps of one token per sequence."""
    n, p = len(prompts_), len(prompts_[0])
    tokens = np.concatenate([np.asarray(x, np.int64) for x in prompts_])
    seqs, pos = np.repeat(np.arange(n), p), np.tile(np.arange(p), n)
    last = pos == p - 1
    nxt, first = np.zeros(n, np.int64), np.zeros(n)
    eng.clear()
    t_submit = time.perf_counter()
    for c in range(0, n * p, batch):
        part = slice(c, c + batch)
        logits = eng.decode_seqs(tokens[part], pos[part], seqs[part], last[part])
        done = seqs[part][last[part]]
        if done.size:
            nxt[done] = np.argmax(logits, axis=1)
            first[done] = time.perf_counter()
    rows, every = np.arange(n), np.ones(n, bool)
    for i in range(gen - 1):
        nxt = np.argmax(eng.decode_seqs(nxt, np.full(n, p + i), rows, every), axis=1)
    t_last = time.perf_counter()
    return [Seq(t_submit, float(first[j]), t_last, p, gen) for j in range(n)]


def _parallel(req: dict[str, Any], pool: np.ndarray,
              speed: dict[str, Any]) -> tuple[dict[int, list[list[Seq]]], dict[str, Any]]:
    """N concurrent sequences for each N in ``speed["parallel"]``, ``repeats`` runs each, on one context of
    ``max(N)`` sequences (see :func:`parallel_context`). Returns the runs and the engine settings."""
    ns = [int(n) for n in speed["parallel"]]
    p, gen, repeats = int(speed["parallel_prompt_tokens"]), int(speed["parallel_gen_tokens"]), int(speed["repeats"])
    shape = parallel_context(max(ns), p, gen)
    eng = _Engine(req, n_ctx=shape["n_ctx"], n_batch=shape["n_batch"], n_seq=max(ns), n_ubatch=shape["n_ubatch"])
    eng.decode_seqs(np.arange(16) % eng.n_vocab, np.arange(16), np.zeros(16, np.int64),
                    np.arange(16) == 15)  # warm-up, as llama-batched-bench's (16 tokens of sequence 0)
    runs = {n: [_concurrent_run(eng, shape["n_batch"], prompts(pool, n, p), gen) for _ in range(repeats)] for n in ns}
    settings = eng.settings(req)
    eng.close()
    return runs, settings


def speed(req: dict[str, Any], pool: np.ndarray) -> dict[str, Any]:
    """The speed result (evaluators.speed.speed_result) for the request's ``speed`` shape, prompts cut from
    ``pool`` (the window ids)."""
    s = req["speed"]
    (prompt,) = prompts(pool, 1, int(s["prompt_tokens"]))
    single, settings = _single_stream(req, prompt, int(s["gen_tokens"]), int(s["repeats"]))
    parallel: dict[int, list[list[Seq]]] = {}
    if s.get("parallel"):
        parallel, par_settings = _parallel(req, pool, s)
        settings = {**settings, "parallel_kv_cache": par_settings["kv_cache"]}
    return speed_result(s, single, parallel, settings, tool="llama-cpp-python (low-level llama_decode)")


def compiled_features(llama_cpp: Any) -> str:
    """The CPU features this llama.cpp build was compiled with, as llama.cpp reports them (its system info's
    ``NAME = 1`` entries: AVX2, AVX512, AMX_INT8, REPACK...): which kernels ran, besides what the CPU has."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return " ".join(m.group(1) for m in re.finditer(r"([A-Z0-9_]+) = 1\b", info))


def main() -> None:
    req = read_request()
    out_dir = Path(req["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    import llama_cpp

    result: dict[str, Any] = {"engine": "llama.cpp", "engine_version": f"llama-cpp-python {llama_cpp.__version__}"
                              + (f" (llama.cpp {req['llama_cpp_commit']})" if req.get("llama_cpp_commit") else ""),
                              "hardware": {**hardware(req["threads"]), "llama_cpp_build": compiled_features(llama_cpp)}}
    if req.get("windows"):
        result["quality"] = _quality(req, out_dir)
    if req.get("speed"):
        pool, _ = load_windows(req["windows"]) if req.get("windows") else (np.arange(1, 600)[None], None)
        result["speed"] = speed(req, pool)
    write_result(out_dir, result)


if __name__ == "__main__":
    main()
