"""llama.cpp's own benchmarks, run on the same GGUF with the settings of Quantyard's llama.cpp runner, their
numbers converted to Quantyard's speed definitions (``evaluators.speed.from_llama_bench`` and
``from_batched_bench``): the reference the runner's speed is cross-checked against
(tests/evaluators/test_speed_crosscheck.py, bench/speed_crosscheck.py).

* batch 1: ``llama-bench -p P -n 0`` (prompt processing, one batch of P tokens: ``-b P -ub P``, as the runner)
  and ``llama-bench -p 0 -n G−1 -d P`` (decode after a P-token prompt), ``-r R`` repetitions each;
* N concurrent sequences: ``llama-batched-bench -npp P -ntg G−1 -npl N,N,…`` (R repetitions of each N) with
  the runner's ``-c``, ``-b`` and ``-ub`` (``evaluators.llamacpp.runner.parallel_context``).

Threads, flash attention (``auto``), KV cache types (f16) and GPU layers (0) are the runner's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from evaluators.llamacpp.evaluator import LlamaCppEvaluator
from evaluators.llamacpp.runner import parallel_context
from evaluators.speed import from_batched_bench, from_llama_bench
from pipeline.config import Settings
from pipeline.errors import EngineError
from pipeline.llama_cpp import LlamaCppToolchain, llama_cpp_toolchain
from pipeline.plan import EvalSpec


def _run(tools: LlamaCppToolchain, cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, env=tools.env(), timeout=timeout_s)
    if res.returncode != 0:
        raise EngineError(f"{Path(cmd[0]).name} exited {res.returncode}", engine="llama.cpp",
                          returncode=res.returncode, stderr_tail=res.stderr[-2000:])
    return res


def llama_bench(tools: LlamaCppToolchain, model: Path, *, prompt_tokens: int, gen_tokens: int, repeats: int,
                threads: int, timeout_s: float = 900) -> dict[str, Any]:
    """Batch-1 time to first token, prompt and decode tok/s (stats over ``repeats``) by llama-bench.

    Raises:
        EngineError: llama-bench failed.
    """
    common = [str(tools.exe("llama-bench")), "-m", str(model), "-r", str(repeats), "-t", str(threads),
              "-ngl", "0", "-fa", "auto", "-o", "json"]
    pp = _run(tools, [*common, "-p", str(prompt_tokens), "-n", "0", "-b", str(prompt_tokens),
                      "-ub", str(prompt_tokens)], timeout_s)
    tg = _run(tools, [*common, "-p", "0", "-n", str(gen_tokens - 1), "-d", str(prompt_tokens),
                      "-b", str(prompt_tokens), "-ub", str(prompt_tokens)], timeout_s)
    rows = [*json.loads(pp.stdout), *json.loads(tg.stdout)]
    return {**from_llama_bench(rows), "tool": "llama-bench", "build": rows[0].get("build_commit")}


def batched_rows(stdout: str) -> list[dict[str, Any]]:
    """The JSONL rows of llama-batched-bench, in order, wherever they start on a line (a log message without a
    newline may precede one)."""
    decoder = json.JSONDecoder()
    rows = []
    start = stdout.find("{")
    while start != -1:
        try:
            row, end = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            start = stdout.find("{", start + 1)
            continue
        if isinstance(row, dict) and "pl" in row:
            rows.append(row)
        start = stdout.find("{", end)
    return rows


def batched_bench(tools: LlamaCppToolchain, model: Path, *, parallel: list[int], prompt_tokens: int,
                  gen_tokens: int, repeats: int, threads: int, timeout_s: float = 1800) -> dict[str, Any]:
    """Aggregate tok/s at each N of ``parallel`` (stats over ``repeats``) by llama-batched-bench.

    llama.cpp's asynchronous logger can lose the last line when the process exits right after it, so a short
    sentinel row (N=1) follows the requested ones; a run whose rows are still incomplete is run once more.

    Raises:
        EngineError: the tool failed, or printed too few rows twice.
    """
    ctx = parallel_context(max(parallel), prompt_tokens, gen_tokens)
    npl = [n for n in parallel for _ in range(repeats)]
    cmd = [str(tools.exe("llama-batched-bench")), "-m", str(model), "-c", str(ctx["n_ctx"]),
           "-b", str(ctx["n_batch"]), "-ub", str(ctx["n_ubatch"]), "-npp", str(prompt_tokens),
           "-ntg", str(gen_tokens - 1), "-npl", ",".join(map(str, [*npl, 1])), "-t", str(threads),
           "-fa", "auto", "-ngl", "0", "--output-format", "jsonl"]
    for _ in range(2):
        res = _run(tools, cmd, timeout_s)
        rows = batched_rows(res.stdout)[:len(npl)]
        if [int(r["pl"]) for r in rows] == npl:
            by = {n: from_batched_bench([r for r in rows if int(r["pl"]) == n]) for n in parallel}
            return {"by_parallel": {str(n): v for n, v in by.items()}, "tool": "llama-batched-bench", **ctx}
    raise EngineError(f"llama-batched-bench printed {len(rows)} of {len(npl)} rows twice", engine="llama.cpp",
                      stderr_tail=res.stdout[-1000:] + res.stderr[-1000:])


#: Per metric: (its key in Quantyard's result, in the tool's converted result, where per N), and whether
#: more is better (rates) or less (TTFT).
METRICS: dict[str, tuple[str, bool]] = {"pp tok/s": ("prompt_tok_per_s", True), "tg tok/s": ("decode_tok_per_s", True),
                                        "TTFT ms": ("ttft_ms", False)}
PARALLEL_METRICS: dict[str, tuple[str, bool]] = {"aggregate tok/s": ("aggregate_tok_per_s", True),
                                                 "decode-only aggregate": ("decode_aggregate_tok_per_s", True)}


def _pick(x: dict[str, Any], key: str, higher: bool) -> tuple[float, float]:
    """(median, best) of a stats entry: best is the max of a rate, the min of a time."""
    return float(x[key]["median"]), float(x[key]["max" if higher else "min"])


def _metrics(ours: dict[str, Any], bench: dict[str, Any], batched: dict[str, Any],
             parallel: tuple[int, ...]) -> dict[str, tuple[tuple[float, float], tuple[float, float], bool]]:
    """``{metric: ((ours median, ours best), (theirs median, theirs best), higher is better)}`` of one round."""
    out = {}
    for name, (key, higher) in METRICS.items():
        theirs = _pick(bench, key, higher)
        if key == "ttft_ms":  # llama.cpp's TTFT: the prompt's time, prompt tokens / its pp rate
            pp = _pick(bench, "prompt_tok_per_s", True)
            theirs = (1000.0 * ours["prompt_tokens"] / pp[0], 1000.0 * ours["prompt_tokens"] / pp[1])
        out[name] = (_pick(ours, key, higher), theirs, higher)
    for n in map(str, parallel):
        mine, tool = ours["parallel"]["by_parallel"][n], batched["by_parallel"][n]
        for name, (key, higher) in PARALLEL_METRICS.items():
            out[f"{name} N={n}"] = (_pick(mine, key, higher), _pick(tool, key, higher), higher)
    return out


def crosscheck(settings: Settings, model: Path, spec: EvalSpec, rounds: int, work: Path) -> list[dict[str, Any]]:
    """Quantyard's llama.cpp speed of one GGUF beside llama.cpp's tools: the evaluator's ``measure_speed`` with
    ``spec``, then llama-bench and llama-batched-bench at the shape it ran, back to back, ``rounds`` times.

    Returns one row per metric (``pp tok/s``, ``tg tok/s``, ``TTFT ms`` — llama.cpp's being the prompt's time,
    prompt tokens / its pp rate —, then per N ``aggregate tok/s`` and ``decode-only aggregate``):

    * ``ours``, ``theirs``: medians over the rounds of each round's median; ``ratios``: ours / theirs of each
      round; ``ratio``: their median (pairing cancels slow drifts of the machine's load);
    * ``best_ours``, ``best_theirs``: the best repetition of all rounds (the highest rate, the shortest TTFT);
      ``best_ratio``: theirs. Foreign load only ever slows a run down, so on a shared machine the best of many
      repetitions is each side's least disturbed figure.

    Raises:
        EngineError: a side failed.
    """
    tools = llama_cpp_toolchain(settings)
    s, threads = spec.speed, settings.threads
    per_round = []
    for r in range(rounds):
        ours, _, _ = LlamaCppEvaluator().measure_speed(model, spec=spec, out_dir=work / f"ours{r}", settings=settings)
        bench = llama_bench(tools, model, prompt_tokens=ours["prompt_tokens"], gen_tokens=ours["gen_tokens"],
                            repeats=s.repeats, threads=threads)
        batched = batched_bench(tools, model, parallel=list(s.parallel), prompt_tokens=ours["parallel_prompt_tokens"],
                                gen_tokens=ours["parallel_gen_tokens"], repeats=s.repeats, threads=threads)
        per_round.append(_metrics(ours, bench, batched, s.parallel))
    rows = []
    for metric, (_, _, higher) in per_round[0].items():
        got = [r[metric] for r in per_round]
        best = max if higher else min
        ratios = [o[0] / t[0] for o, t, _ in got]
        best_ours, best_theirs = best(o[1] for o, _, _ in got), best(t[1] for _, t, _ in got)
        rows.append({"metric": metric, "ours": statistics.median(o[0] for o, _, _ in got),
                     "theirs": statistics.median(t[0] for _, t, _ in got), "ratio": statistics.median(ratios),
                     "ratios": ratios, "best_ours": best_ours, "best_theirs": best_theirs,
                     "best_ratio": best_ours / best_theirs})
    return rows
