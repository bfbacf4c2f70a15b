"""How to use the machine when several variants of one source are evaluated: three schedules of the same job,
measured one after the other on this machine with llama.cpp's own tools (the pinned build of
pipeline/llama_cpp.py), so that only the schedule differs.

The job: Q8_0, Q4_K_M and Q2_K quantized from an F16 base GGUF and each scored with ``llama-perplexity
--kl-divergence`` against the F16's stored log-probs on ``--windows`` 512-token chunks of the checkpoint's
``eval.txt``. The F16 and its ``--kl-divergence-base`` file are made once, before the schedules, and are not
timed: every schedule reads the same stored reference.

* ``sequential``: quantize a type, evaluate it, next type; every process gets every thread. What Quantyard's
  embedded executor (``quantyard convert``) does.
* ``overlap``: evaluate type i while type i+1 quantizes, both processes with every thread (the OS shares the
  cores); what the distributed executor does when the graph lets evaluate:i run beside build:i+1.
* ``parallel``: quantize every type, then evaluate all of them at once, each with threads / types threads
  (at least one): several variants scored in one pass of wall time over the same stored reference.

Each schedule prints its wall time, its ratio to ``sequential``, and the KLD of every type (the same in every
schedule, up to llama.cpp's thread-count rounding: a check that the schedules did the same work).

Usage: python bench/overlap.py [--model real|demo] [--windows 32] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: a script's own folder

from pipeline_vs_llamacpp import CTX, QUANTS, _timed, checkpoint, header

from evaluators.llamacpp.crosscheck import kl_divergence, save_base
from pipeline.config import Settings
from pipeline.llama_cpp import LlamaCppToolchain, llama_cpp_toolchain


def quantize(tools: LlamaCppToolchain, base: Path, out: Path, q: str, threads: int) -> float:
    out.unlink(missing_ok=True)
    return _timed([str(tools.exe("llama-quantize")), str(base), str(out), q, str(threads)], tools.env())


def evaluate(tools: LlamaCppToolchain, model: Path, ref: Path, threads: int) -> float:
    return kl_divergence(tools, model, ref, threads=threads).kld_mean


def sequential(tools: LlamaCppToolchain, base: Path, ref: Path, work: Path, threads: int) -> dict[str, float]:
    out = {}
    for q in QUANTS:
        quantize(tools, base, work / f"{q}.gguf", q, threads)
        out[q] = evaluate(tools, work / f"{q}.gguf", ref, threads)
    return out


def overlap(tools: LlamaCppToolchain, base: Path, ref: Path, work: Path, threads: int) -> dict[str, float]:
    out: dict[str, float] = {}
    quantize(tools, base, work / f"{QUANTS[0]}.gguf", QUANTS[0], threads)
    with ThreadPoolExecutor(2) as pool:
        for i, q in enumerate(QUANTS):
            ev: Future[float] = pool.submit(evaluate, tools, work / f"{q}.gguf", ref, threads)
            if i + 1 < len(QUANTS):
                nxt = QUANTS[i + 1]
                pool.submit(quantize, tools, base, work / f"{nxt}.gguf", nxt, threads).result()
            out[q] = ev.result()
    return out


def parallel(tools: LlamaCppToolchain, base: Path, ref: Path, work: Path, threads: int) -> dict[str, float]:
    for q in QUANTS:
        quantize(tools, base, work / f"{q}.gguf", q, threads)
    each = max(1, threads // len(QUANTS))
    with ThreadPoolExecutor(len(QUANTS)) as pool:
        futures = {q: pool.submit(evaluate, tools, work / f"{q}.gguf", ref, each) for q in QUANTS}
        return {q: f.result() for q, f in futures.items()}


SCHEDULES = {"sequential": sequential, "overlap": overlap, "parallel": parallel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("demo", "real"), default="real")
    ap.add_argument("--windows", type=int, default=32, help="512-token chunks of eval.txt (default 32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None, help="also write the table, with a header, here")
    args = ap.parse_args()
    load = os.getloadavg()
    cfg = Settings(threads=args.threads)
    tools = llama_cpp_toolchain(cfg)
    ckpt = checkpoint(args.model, cfg)
    lines = [header(sys.argv, load, args.threads), f"# model: {args.model} ({ckpt}), {args.windows} windows x {CTX}",
             "", "| schedule | wall s | / sequential | " + " | ".join(f"KLD {q}" for q in QUANTS) + " |",
             "|---|---|---|" + "---|" * len(QUANTS)]
    with tempfile.TemporaryDirectory(dir=cfg.work_root, prefix="bench-overlap-") as tmp:
        work = Path(tmp)
        base = work / "F16.gguf"
        _timed([cfg.core_python, str(tools.converter), str(ckpt), "--outfile", str(base), "--outtype", "f16"],
               tools.converter_env())
        ref = work / "base.kld"
        save_base(tools, base, ckpt / "eval.txt", ref, ctx=CTX, chunks=args.windows, threads=args.threads)
        first = 0.0
        for name, schedule in SCHEDULES.items():
            print(f"[{name}] ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            klds = schedule(tools, base, ref, work, args.threads)
            wall = time.perf_counter() - t0
            first = first or wall
            lines.append(f"| {name} | {wall:.1f} | {wall / first:.3f} | "
                         + " | ".join(f"{klds[q]:.6f}" for q in QUANTS) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
