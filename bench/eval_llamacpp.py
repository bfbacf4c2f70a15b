"""Throughput of Quantyard's llama.cpp evaluator vs ``llama-perplexity`` of the same build.

Both process the same model and the same number of tokens (N windows × W tokens). We report:

* eval throughput — tokens/s of the evaluation loop: ours includes our per-position scoring
  (log-softmax, top-K, tail mass, gathering at the reference ids); llama-perplexity's is measured
  from its own log timestamps between "calculating perplexity" and "Final estimate" (its decode plus
  its scoring of half of each chunk);
* end-to-end — tokens / wall seconds of the whole process (load, tokenization, everything).

Each side runs REPEATS times; medians are compared (2-thread timings on a busy 2-core machine swing
widely, see TOOLCHAINS.md). Usage: python bench/eval_llamacpp.py [--type Q4_K_M] [--windows 32] [--repeats 3]
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

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf import GGUFConverter, llama_cpp_bin_dir, tool_env
from converters.source import resolve_source
from evaluators.base import RunnerCommand, run_runner
from evaluators.windows import build_window_set
from pipeline.config import Settings
from pipeline.demo_model import cached_demo_model
from pipeline.specs import Engine, GGUFSpec


def build_model(cfg: Settings, gguf_type: str, work: Path) -> tuple[Path, Path]:
    demo = cached_demo_model(cfg.cache_dir)
    ckpt = load_checkpoint(demo)
    ctx = BuildContext(checkpoint=ckpt, source=resolve_source(str(demo), cache_dir=cfg.cache_dir),
                       model_name="demo", settings=cfg)
    conv = GGUFConverter(cfg.llama_cpp_tools_dir)
    prepared = conv.prepare(ctx, [])
    built = conv.build(ctx, prepared, GGUFSpec(type=gguf_type), work / gguf_type)
    return next(iter(built.files.values())), demo


def ours(cfg: Settings, model: Path, windows: Path, work: Path, i: int) -> tuple[float, float]:
    cmd = RunnerCommand(engine=Engine.LLAMA_CPP, python=cfg.core_python, module="evaluators.runners.llamacpp")
    t0 = time.perf_counter()
    out = run_runner(cmd, {"model": str(model), "windows": str(windows), "ref_topk": None, "top_k": 32,
                           "threads": cfg.threads}, work / f"ours-{i}", 3600)
    wall = time.perf_counter() - t0
    return float(out.result["quality"]["eval_tok_per_s"]), wall


def theirs(cfg: Settings, model: Path, text: Path, window: int, n_windows: int) -> tuple[float, float, int]:
    exe = llama_cpp_bin_dir() / "llama-perplexity"
    cmd = [str(exe), "-m", str(model), "-f", str(text), "-c", str(window), "-b", str(window), "-ub", str(window),
           "--chunks", str(n_windows), "-t", str(cfg.threads), "-tb", str(cfg.threads)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=tool_env(), check=True)
    wall = time.perf_counter() - t0
    log = res.stdout + res.stderr
    # llama.cpp log lines start with "M.SS.mmm.uuu" (minutes, seconds, ms, us since start).
    stamp = r"(\d+)\.(\d+)\.(\d+)\.(\d+) I "

    def at(pattern: str) -> float:
        m = re.search(stamp + pattern, log)
        if not m:
            raise SystemExit(f"could not find {pattern!r} in llama-perplexity output:\n" + log[-2000:])
        mi, se, ms, us = (int(g) for g in m.groups())
        return mi * 60 + se + ms / 1e3 + us / 1e6

    loop_s = at(r"Final estimate") - at(r"perplexity: calculating perplexity")
    n = n_windows * window
    return n / loop_s, wall, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cfg = Settings(threads=args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, demo = build_model(cfg, args.type, work)
        text = (demo / "eval.txt").read_text()
        ws = build_window_set(demo, text, window=args.window, stride=args.window, max_windows=args.windows)
        ws.save(work / "w.npz")
        (work / "eval.txt").write_text(text)
        n_tokens = ws.n_windows * ws.window
        rows = []
        for i in range(args.repeats):  # interleave the two tools so machine load hits both alike
            o_tps, o_wall = ours(cfg, model, work / "w.npz", work, i)
            t_tps, t_wall, t_n = theirs(cfg, model, work / "eval.txt", args.window, ws.n_windows)
            rows.append({"ours_eval_tps": o_tps, "ours_wall_s": o_wall, "theirs_eval_tps": t_tps,
                         "theirs_wall_s": t_wall, "theirs_tokens": t_n})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary = {
        "model": f"demo {args.type}", "tokens": n_tokens, "threads": args.threads, "repeats": args.repeats,
        "ours_eval_tok_per_s": round(med["ours_eval_tps"], 1),
        "llama_perplexity_eval_tok_per_s": round(med["theirs_eval_tps"], 1),
        "eval_throughput_ratio": round(med["ours_eval_tps"] / med["theirs_eval_tps"], 3),
        "end_to_end_ratio": round((n_tokens / med["ours_wall_s"]) / (med["theirs_tokens"] / med["theirs_wall_s"]), 3),
        "runs": rows,
    }
    print(json.dumps(summary, indent=2))
    ratio = summary["eval_throughput_ratio"]
    print(f"\neval throughput ratio (ours / llama-perplexity): {ratio:.3f}  (target >= 0.95)")
    print(f"end-to-end ratio (ours / llama-perplexity):     {summary['end_to_end_ratio']:.3f}")


if __name__ == "__main__":
    main()
