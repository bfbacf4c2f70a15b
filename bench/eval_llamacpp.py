"""Throughput of Quantyard's llama.cpp evaluator vs ``llama-perplexity`` of the same build.

Both process the same model and the same tokens: N windows × W tokens, each window BOS + the next
W-1 text tokens, which is exactly how llama-perplexity cuts its chunks. Two comparisons:

* **matched** (the headline): our window set scores the same positions llama-perplexity scores (the
  second half of each window, ``--score-from W/2+1``), so both do the same work; the two perplexities
  are printed side by side and must agree (they are the same computation);
* **all positions**: our default window set, which scores every position of every window (twice the
  positions, for the same tokens processed) — what a default `quantyard convert` does.

Per comparison: eval throughput — tokens/s of the evaluation loop: ours includes our per-position
scoring (log-softmax, top-K, tail mass, gathering at the reference ids); llama-perplexity's is measured
from its own log timestamps between "calculating perplexity" and "Final estimate" (its decode plus its
scoring); end-to-end — tokens / wall seconds of the whole process (load, tokenization, everything).

Each side runs REPEATS times, interleaved in pairs (which tool goes first alternates); the headline is the
median of these paired ratios (2-thread timings on a busy 2-core machine swing by ±15 % from run to run,
see TOOLCHAINS.md; pairing cancels the slow drifts), with the ratio of the medians beside it.
Usage: python bench/eval_llamacpp.py [--type Q4_K_M] [--windows 32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import GGUFConverter
from converters.source import resolve_source
from evaluators.base import RunnerCommand, load_arrays, run_runner
from evaluators.metrics import perplexity
from evaluators.windows import build_window_set
from pipeline.config import Settings
from pipeline.demo_model import cached_demo_model
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.specs import Engine, GGUFSpec


def build_model(cfg: Settings, gguf_type: str, work: Path) -> tuple[Path, Path]:
    demo = cached_demo_model(cfg.cache_dir)
    ckpt = load_checkpoint(demo)
    ctx = BuildContext(checkpoint=ckpt, source=resolve_source(str(demo), cache_dir=cfg.cache_dir),
                       model_name="demo", settings=cfg)
    conv = GGUFConverter(cfg)
    prepared = conv.prepare(ctx, [])
    built = conv.build(ctx, prepared, GGUFSpec(type=gguf_type), work / gguf_type)
    return next(iter(built.files.values())), demo


def ours(cfg: Settings, model: Path, windows: Path, ref: Path | None, work: Path,
         tag: str) -> tuple[float, float, float, Path]:
    """(eval tok/s, wall s, perplexity, log-probs file) of our runner; with ``ref`` it also gathers at the
    reference's top-K, as a variant evaluation does."""
    cmd = RunnerCommand(engine=Engine.LLAMA_CPP, python=cfg.core_python, module="evaluators.llamacpp.runner")
    t0 = time.perf_counter()
    out = run_runner(cmd, {"model": str(model), "windows": str(windows), "ref_topk": str(ref) if ref else None,
                           "top_k": 32, "threads": cfg.threads}, work / tag, 3600)
    wall = time.perf_counter() - t0
    assert out.arrays is not None
    ppl = perplexity(load_arrays(out.arrays)["target_logprob"]).ppl
    return float(out.result["quality"]["eval_tok_per_s"]), wall, ppl, out.arrays


def theirs(cfg: Settings, model: Path, text: Path, window: int,
           n_windows: int) -> tuple[float, float, int, float, int]:
    """(eval tok/s, wall s, tokens, perplexity, retries) of llama-perplexity. llama.cpp's asynchronous
    logger can lose the last lines when the process exits right after them (see TOOLCHAINS.md); a run whose
    "Final estimate" line is lost is run again (at most twice; the retries are reported)."""
    for attempt in range(3):
        got = _theirs_once(cfg, model, text, window, n_windows, last=attempt == 2)
        if got is not None:
            return (*got, attempt)
    raise AssertionError("unreachable")


def _theirs_once(cfg: Settings, model: Path, text: Path, window: int, n_windows: int,
                 last: bool) -> tuple[float, float, int, float] | None:
    tools = llama_cpp_toolchain(cfg)
    exe = tools.exe("llama-perplexity")
    cmd = [str(exe), "-m", str(model), "-f", str(text), "-c", str(window), "-b", str(window), "-ub", str(window),
           "--chunks", str(n_windows), "-t", str(cfg.threads), "-tb", str(cfg.threads)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=tools.env(), check=True)
    wall = time.perf_counter() - t0
    log = res.stdout + res.stderr
    # llama.cpp log lines start with "M.SS.mmm.uuu" (minutes, seconds, ms, us since start).
    stamp = r"(\d+)\.(\d+)\.(\d+)\.(\d+) I "

    def at(pattern: str) -> float | None:
        m = re.search(stamp + pattern, log)
        if not m:
            if last:
                raise SystemExit(f"could not find {pattern!r} in llama-perplexity output:\n" + log[-2000:])
            return None
        mi, se, ms, us = (int(g) for g in m.groups())
        return mi * 60 + se + ms / 1e3 + us / 1e6

    end, begin = at(r"Final estimate"), at(r"perplexity: calculating perplexity")
    if end is None or begin is None:
        return None
    loop_s = end - begin
    n = n_windows * window
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if not ppl:
        raise SystemExit("no final PPL in llama-perplexity output:\n" + log[-2000:])
    return n / loop_s, wall, n, float(ppl.group(1))


def _summary(rows: list[dict[str, float]], n_tokens: int) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    paired = [r["ours_eval_tps"] / r["theirs_eval_tps"] for r in rows]  # each pair ran back to back
    return {
        "ours_eval_tok_per_s": round(med["ours_eval_tps"], 1),
        "llama_perplexity_eval_tok_per_s": round(med["theirs_eval_tps"], 1),
        "eval_throughput_ratio": round(med["ours_eval_tps"] / med["theirs_eval_tps"], 3),
        "paired_ratio_median": round(statistics.median(paired), 3),
        "paired_ratio_min": round(min(paired), 3), "paired_ratio_max": round(max(paired), 3),
        "end_to_end_ratio": round((n_tokens / med["ours_wall_s"]) / (n_tokens / med["theirs_wall_s"]), 3),
        "ours_ppl": rows[0]["ours_ppl"], "llama_perplexity_ppl": rows[0]["theirs_ppl"],
        "runs": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cfg = Settings(threads=args.threads)
    half = args.window // 2 + 1  # llama-perplexity scores targets n_ctx/2+1 .. n_ctx-1 of each chunk
    modes = {"matched": half, "all_positions": 1}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, demo = build_model(cfg, args.type, work)
        text = (demo / "eval.txt").read_text()
        (work / "eval.txt").write_text(text)
        sets, refs = {}, {}
        for mode, score_from in modes.items():
            ws = build_window_set(demo, text, window=args.window, stride=args.window, max_windows=args.windows,
                                  score_from=score_from)
            ws.save(work / f"{mode}.npz")
            sets[mode] = ws
            # A reference top-K file for the window set (here: the model's own first run), so our runner also
            # gathers at reference ids, as a variant evaluation does.
            refs[mode] = ours(cfg, model, work / f"{mode}.npz", None, work, f"ref-{mode}")[3]
        n_windows = sets["matched"].n_windows
        n_tokens = n_windows * args.window
        rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for i in range(args.repeats):  # interleave the tools so that machine load hits both alike
            for mode in modes:
                if i % 2:  # alternate which tool runs first, so an order effect does not favour either
                    t_tps, t_wall, t_n, t_ppl, retries = theirs(cfg, model, work / "eval.txt", args.window, n_windows)
                o_tps, o_wall, o_ppl, _ = ours(cfg, model, work / f"{mode}.npz", refs[mode], work, f"{mode}-{i}")
                if not i % 2:
                    t_tps, t_wall, t_n, t_ppl, retries = theirs(cfg, model, work / "eval.txt", args.window, n_windows)
                if t_n != n_tokens:
                    raise SystemExit(f"llama-perplexity processed {t_n} tokens, we processed {n_tokens}")
                rows[mode].append({"ours_eval_tps": o_tps, "ours_wall_s": o_wall, "ours_ppl": o_ppl,
                                   "theirs_eval_tps": t_tps, "theirs_wall_s": t_wall, "theirs_ppl": t_ppl,
                                   "theirs_retries": retries})
    summary = {"model": f"demo {args.type}", "tokens": n_tokens, "windows": n_windows, "window": args.window,
               "threads": args.threads, "repeats": args.repeats,
               "scored_positions": {m: sets[m].n_scored for m in modes},
               **{m: _summary(rows[m], n_tokens) for m in modes}}
    print(json.dumps(summary, indent=2))
    m, a = summary["matched"], summary["all_positions"]
    print(f"\nmatched (same tokens, same {sets['matched'].n_scored} scored positions):")
    print(f"  eval throughput ratio (ours / llama-perplexity): {m['paired_ratio_median']:.3f}  (target >= 0.95)")
    print(f"    median of {args.repeats} back-to-back pairs, range "
          f"{m['paired_ratio_min']:.3f}..{m['paired_ratio_max']:.3f}; "
          f"ratio of the medians {m['eval_throughput_ratio']:.3f}")
    print(f"  end-to-end ratio:                                {m['end_to_end_ratio']:.3f}")
    print(f"  perplexity: ours {m['ours_ppl']:.4f}, llama-perplexity {m['llama_perplexity_ppl']:.4f}")
    print(f"all positions (ours scores {sets['all_positions'].n_scored}, llama-perplexity "
          f"{sets['matched'].n_scored}):")
    print(f"  eval throughput ratio: {a['paired_ratio_median']:.3f} (pairs' median; ratio of medians "
          f"{a['eval_throughput_ratio']:.3f})   end-to-end ratio: {a['end_to_end_ratio']:.3f}")


if __name__ == "__main__":
    main()
