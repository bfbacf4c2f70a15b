"""Quantyard's llama.cpp speed beside llama.cpp's own benchmarks of the same build, in Quantyard's definitions.

For every GGUF variant of the demo checkpoint (and, with ``--real``, of the real pretrained checkpoint,
pipeline/real_model.py), on the same machine and threads: Quantyard's llama.cpp runner (the evaluator's
``measure_speed``, the CPU-scaled shape unless ``--prompt``/``--gen`` say otherwise) against ``llama-bench``
(batch 1: pp, tg at the prompt's depth, TTFT = the prompt's time) and ``llama-batched-bench`` (aggregate
generated tok/s at N concurrent sequences, end to end), converted as evaluators/speed.py defines
(evaluators/llamacpp/reference_tools.py). The sides run interleaved, ``--rounds`` times with ``--repeats``
each; every figure is the median of the rounds' medians, and the ratio is the median of the rounds' ratios
(ours / theirs of each round, measured back to back: pairing cancels the machine's slow drifts). Beside them,
each side's best repetition of all rounds (highest rate, shortest TTFT) and their ratio: foreign load only
slows a run, so on a shared machine the best is each side's least disturbed figure (what the test compares).

Usage: python bench/speed_crosscheck.py [--types Q8_0,Q4_K_M,Q2_K] [--real [--real-types Q4_K_M]] [--rounds 5]
       [--repeats 5] [--parallel 1,8,32] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import GGUFConverter
from converters.source import resolve_source
from evaluators.base import speed_request
from evaluators.llamacpp.reference_tools import crosscheck
from pipeline.config import Settings
from pipeline.cpu import cpu_flags
from pipeline.demo_model import cached_demo_model
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.plan import EvalSpec, SpeedSpec
from pipeline.specs import GGUFSpec

ROOT = Path(__file__).resolve().parent.parent


def build_ggufs(cfg: Settings, checkpoint: Path, name: str, types: list[str], work: Path) -> dict[str, Path]:
    """GGUF files of ``checkpoint`` (one F16/BF16 base, then each type), as the pipeline builds them."""
    ckpt = load_checkpoint(checkpoint)
    ctx = BuildContext(checkpoint=ckpt, source=resolve_source(str(checkpoint), cache_dir=cfg.cache_dir),
                       model_name=name, settings=cfg)
    conv = GGUFConverter(cfg)
    prepared = conv.prepare(ctx, [])
    return {t: next(iter(conv.build(ctx, prepared, GGUFSpec(type=t), work / f"{name}-{t}").files.values()))
            for t in types}


def header(args: argparse.Namespace, cfg: Settings, shape: dict[str, Any]) -> list[str]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    changed = " ".join(line[3:] for line in dirty.splitlines())
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    tools = llama_cpp_toolchain(cfg)
    return [f"# python bench/speed_crosscheck.py {shlex.join(sys.argv[1:])}",
            f"# commit {commit.strip()}{f' (uncommitted changes in: {changed})' if changed else ''}, "
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}; llama.cpp {tools.commit} (llama-cpp-python 0.3.36)",
            f"# machine: {cpu}, {os.cpu_count()} cores, threads {cfg.threads}; ISA flags: {cpu_flags()}",
            f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
            f"# shape: {shape['shape']} — batch 1: {shape['prompt_tokens']} prompt / {shape['gen_tokens']} generated; "
            f"N={','.join(map(str, shape['parallel']))}: {shape['parallel_prompt_tokens']} / "
            f"{shape['parallel_gen_tokens']}; {args.rounds} interleaved rounds × {args.repeats} repeats; "
            "Quantyard / llama.cpp: medians of the rounds' medians, ratio = median over rounds of the per-round "
            "ratio; best = best repetition of all rounds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q8_0,Q4_K_M,Q2_K")
    ap.add_argument("--real", action="store_true", help="also the real pretrained checkpoint's GGUFs")
    ap.add_argument("--real-types", default="Q4_K_M", help="the real checkpoint's types (each takes minutes)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parallel", default="1,8,32")
    ap.add_argument("--threads", type=int, default=1, help="both sides (1: robust on a shared machine, see the test)")
    args = ap.parse_args()
    cfg = Settings(threads=args.threads)
    spec = EvalSpec(speed=SpeedSpec(repeats=args.repeats, parallel=tuple(int(n) for n in args.parallel.split(","))))
    shape = speed_request(spec, "cpu")
    assert shape is not None
    print("\n".join(header(args, cfg, shape)), flush=True)
    models = {"demo": (cached_demo_model(cfg.cache_dir), args.types.split(","))}
    if args.real:
        from flows.steps import real_checkpoint

        models["smollm2-135m"] = (real_checkpoint(cfg), args.real_types.split(","))
    print(f"{'model':<13} {'variant':<7} {'metric':<26} {'Quantyard':>10} {'llama.cpp':>10} {'ratio':>6}  "
          f"{'best ours':>10} {'best tool':>10} {'ratio':>6}  {'per-round ratios (medians)':<40} tool")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (checkpoint, types) in models.items():
            for t, gguf in build_ggufs(cfg, checkpoint, name, types, Path(tmp)).items():
                for row in crosscheck(cfg, gguf, spec, args.rounds, Path(tmp) / f"{name}-{t}-runs"):
                    tool = "llama-batched-bench" if "aggregate" in row["metric"] else "llama-bench"
                    each = " ".join(f"{x:.2f}" for x in row["ratios"])
                    print(f"{name:<13} {t:<7} {row['metric']:<26} {row['ours']:>10,.1f} {row['theirs']:>10,.1f} "
                          f"{row['ratio']:>6.3f}  {row['best_ours']:>10,.1f} {row['best_theirs']:>10,.1f} "
                          f"{row['best_ratio']:>6.3f}  {each:<40} {tool}", flush=True)
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
