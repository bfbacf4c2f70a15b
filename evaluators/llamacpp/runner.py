"""llama.cpp runner (llama-cpp-python): log-probs on the shared windows, then speed.

Quality: each window is evaluated as one batch; llama.cpp returns the logits of the scored
positions only, and they feed the shared Collector. Speed (when asked): prompt processing tok/s
and time to first token on a ``prompt_tokens`` prompt, decode tok/s over ``gen_tokens``
greedy tokens, each repeated ``repeats`` times (median/min/max); throughput at several
parallel sequences comes from ``llama-batched-bench`` of the same build.
"""

from __future__ import annotations

import json
import subprocess
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
    stats,
    write_result,
)

FLASH_ATTN = {"auto": -1, "on": 1, "off": 0}  # llama_flash_attn_type; llama.cpp's own tools default to auto


class _Engine:
    """One model and context on llama-cpp-python's low-level bindings, one sequence, with a batch whose
    per-token logits flags we set (``Llama.eval`` asks for all rows or only the last). Flash attention is
    ``auto`` unless the request says otherwise, as in llama.cpp's own tools (llama-perplexity, llama-bench)."""

    def __init__(self, req: dict[str, Any], n_ctx: int, n_batch: int) -> None:
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
        self.model = _internals.LlamaModel(path_model=req["model"], params=mparams, verbose=False)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = 1
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
    n = col.save(out_dir)
    eng.close()
    return {"n_positions": n, "eval_s": t.s, "eval_tok_per_s": ids.size / t.s, "n_vocab": eng.n_vocab,
            "flash_attn": eng.flash_attn}


def _single_stream(req: dict[str, Any], prompt: list[int], gen: int, repeats: int) -> dict[str, Any]:
    """Prompt processing and time to first token (the prompt as one batch, logits of its last row only),
    then greedy decoding of ``gen`` tokens one by one."""
    eng = _Engine(req, n_ctx=len(prompt) + gen + 8, n_batch=len(prompt))
    eng.decode(prompt[:16], 0, 15)  # warm-up: page in weights, build graphs
    pp, ttft, tg = [], [], []
    for _ in range(repeats):
        eng.clear()
        t0 = time.perf_counter()
        tok = int(np.argmax(eng.decode(prompt, 0, len(prompt) - 1)[0]))
        t1 = time.perf_counter()
        for i in range(gen):
            tok = int(np.argmax(eng.decode([tok], len(prompt) + i, 0)[0]))
        t2 = time.perf_counter()
        pp.append(len(prompt) / (t1 - t0))
        ttft.append((t1 - t0) * 1000.0)
        tg.append(gen / (t2 - t1))
    eng.close()
    return {"prompt_tok_per_s": stats(pp), "ttft_ms": stats(ttft), "decode_tok_per_s": stats(tg),
            "flash_attn": eng.flash_attn}


def _parallel(req: dict[str, Any], speed: dict[str, Any]) -> dict[str, Any]:
    """Aggregate decode throughput at N parallel sequences, via llama-batched-bench (same build).

    Every requested N must come back: a missing row is measured again once, then reported as an error
    with the tool's output (never silently dropped). The tool prints its rows through llama.cpp's
    asynchronous logger, which can lose the last line when the process exits right after it: a short
    sentinel run (N=1 again) follows the requested ones so that the real last row gets written."""
    rows: dict[str, dict[str, Any]] = {}
    todo = [int(n) for n in speed["parallel"]]
    for _ in range(2):
        out = _batched_bench(req, speed, todo)
        if out.returncode != 0:
            return {"error": f"llama-batched-bench exited {out.returncode}: {out.stderr[-800:]}"}
        rows.update(_bench_rows(out.stdout))
        todo = [n for n in todo if str(n) not in rows]
        if not todo:
            return {"by_parallel": rows, "tool": "llama-batched-bench"}
    return {"by_parallel": rows, "tool": "llama-batched-bench",
            "error": f"llama-batched-bench printed no result for {todo} parallel sequences; stdout tail: "
                     f"{out.stdout[-600:]!r}; stderr tail: {out.stderr[-600:]!r}"}


def _batched_bench(req: dict[str, Any], speed: dict[str, Any], npl: list[int]) -> subprocess.CompletedProcess[str]:
    bin_dir = Path(speed["bin_dir"])
    pp, tg = int(speed["parallel_prompt_tokens"]), int(speed["parallel_gen_tokens"])
    ctx = max(npl) * (pp + tg) + 64
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", req["model"], "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, [*npl, 1])), "-t", str(req["threads"]),
           "--output-format", "jsonl", "-ngl", str(req.get("n_gpu_layers", 0))]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=speed.get("timeout_s", 1800))


def _bench_rows(stdout: str) -> dict[str, dict[str, Any]]:
    """The JSONL rows of llama-batched-bench, wherever they start on a line (a log message without a
    newline may precede one)."""
    decoder = json.JSONDecoder()
    rows = {}
    start = stdout.find("{")
    while start != -1:
        try:
            row, end = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            start = stdout.find("{", start + 1)
            continue
        if isinstance(row, dict) and "pl" in row and str(row["pl"]) not in rows:  # the sentinel repeats N=1
            rows[str(row["pl"])] = {"aggregate_tok_per_s": row.get("speed"), "decode_tok_per_s": row.get("speed_tg"),
                                    "prompt_tok_per_s": row.get("speed_pp"), "prompt_tokens": row.get("pp"),
                                    "gen_tokens": row.get("tg")}
        start = stdout.find("{", end)
    return rows


def main() -> None:
    req = read_request()
    out_dir = Path(req["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    import llama_cpp

    result: dict[str, Any] = {"engine": "llama.cpp", "engine_version": f"llama-cpp-python {llama_cpp.__version__}"
                              + (f" (llama.cpp {req['llama_cpp_commit']})" if req.get("llama_cpp_commit") else ""),
                              "hardware": hardware(req["threads"])}
    if req.get("windows"):
        result["quality"] = _quality(req, out_dir)
    speed = req.get("speed")
    if speed:
        ids, _ = load_windows(req["windows"]) if req.get("windows") else (np.arange(1, 600)[None], None)
        flat = ids.reshape(-1).tolist()
        prompt = (flat * (speed["prompt_tokens"] // max(1, len(flat)) + 1))[: speed["prompt_tokens"]]
        result["speed"] = _single_stream(req, prompt, int(speed["gen_tokens"]), int(speed["repeats"]))
        result["speed"]["prompt_tokens"] = len(prompt)
        result["speed"]["gen_tokens"] = int(speed["gen_tokens"])
        result["speed"]["repeats"] = int(speed["repeats"])
        if speed.get("parallel"):
            result["speed"]["parallel"] = _parallel(req, speed)
    write_result(out_dir, result)


if __name__ == "__main__":
    main()
