"""The README's real-checkpoint table: `quantyard demo --real` on SmolLM2-135M-Instruct, and beside every GGUF
row what `llama-perplexity` (same llama.cpp build) computes on the same file and the same scored positions:
512-token chunks of the checkpoint's eval.txt, second half of each chunk scored, which is what
`--score-from 257` makes Quantyard score. Perplexity must agree to the 4 decimals llama-perplexity prints;
KLD is `llama-perplexity --kl-divergence` against `--kl-divergence-base` of the registry's F16 GGUF, beside
Quantyard's exact full-vocabulary KLD against its transformers reference (printed for comparison: the two
references differ by the F16 GGUF's own KLD, about 1e-6 here).
Usage: python bench/real_model.py [--windows 64] [--registry DIR] [--markdown]
The flow runs as the documented command, in a subprocess, and is timed; with an existing --registry it
reuses what is there (a second run takes seconds). The checkpoint's weights are dequantized from a Q4_1
GGUF (pipeline/real_model.py): every number is kinder than on the original release.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from evaluators.llamacpp.crosscheck import LlamaKLD, kl_divergence, save_base
from flows.steps import real_checkpoint
from pipeline.config import Settings
from pipeline.llama_cpp import LlamaCppToolchain, llama_cpp_toolchain
from pipeline.real_model import WEIGHTS_NOTE
from pipeline.results import kld_of
from pipeline.shown import DENSE_KERNEL, dense_kernel, engine_mark, legend, mark_of, pick, role_of
from registry import open_registry

MODEL = "smollm2-135m"


def llama_kld(tools: LlamaCppToolchain, files: dict[str, Path], text: Path, ctx: int, chunks: int,
              threads: int, work: Path) -> dict[str, LlamaKLD]:
    """llama-perplexity's PPL and KLD of every GGUF in ``files`` against a base stored from ``files["F16"]``."""
    base = work / "base.kld"
    save_base(tools, files["F16"], text, base, ctx=ctx, chunks=chunks, threads=threads)
    return {name: kl_divergence(tools, path, base, threads=threads) for name, path in files.items()}


def run_flow(registry: Path, windows: int) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pipeline.cli", "demo", "--real", "--windows", str(windows),
           "--registry", str(registry)]
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def rows(registry: Path, windows: int, checkpoint: Path, cfg: Settings, work: Path) -> list[dict[str, Any]]:
    reg = open_registry(str(registry), create=False)
    out = []
    order = {"gguf": 0, "awq": 1, "exl2": 2}
    views = sorted(reg.latest_versions(MODEL), key=lambda v: (order.get(v.format, 9), -v.size))
    ggufs = {v.variant: next(p for p in reg.pull(v.ref, work / "pull" / v.variant) if p.suffix == ".gguf")
             for v in views if v.format == "gguf"}
    t0 = time.perf_counter()
    llama = llama_kld(llama_cpp_toolchain(cfg), ggufs, checkpoint / "eval.txt", 512, windows, cfg.threads, work)
    llama_s = time.perf_counter() - t0
    for view in views:
        shown = pick(view.format, view.results)
        m = shown.quality.metrics if shown.quality is not None else {}
        kld = kld_of(m)
        row: dict[str, Any] = {"variant": view.variant, "format": view.format, "size_mb": view.size / 1e6,
                               "bpw": (view.lineage.get("info") or {}).get("bpw"),
                               "engine": shown.quality.engine if shown.quality else None,
                               "ppl": m.get("ppl"), "ref_ppl": m.get("ref_ppl"),
                               "kld": kld.value if kld.exact else None, "kld_method": m.get("kld_method"),
                               "kld_ci95": kld.ci95, "top1": m.get("top1_agreement"), "n_tokens": m.get("n_tokens"),
                               "dtype": m.get("dtype"), "kernel": m.get("wna16_kernel"), "marks": []}
        engine = shown.quality.engine if shown.quality else None
        row["marks"] = [mk.key for mk in (engine_mark(view.format, engine, role_of(view.format, engine)),
                                          DENSE_KERNEL if dense_kernel(m) else None) if mk]
        cross = [r for role, r in shown.others if role == "cross-check"]
        if cross:
            row["cross_check"] = {"engine": cross[0].engine, "ppl": cross[0].metrics.get("ppl"),
                                  "kld": kld_of(cross[0].metrics).value}
        if view.variant in llama:
            lk = llama[view.variant]
            row.update(llama_ppl=lk.ppl, llama_kld=lk.kld_mean, llama_same_top_pct=lk.same_top_pct,
                       ppl_diff=(row["ppl"] - lk.ppl) if row["ppl"] is not None else None)
        out.append(row)
    out.append({"llama_perplexity_s": llama_s})
    return out


def fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(table: list[dict[str, Any]], flow_s: float | None, windows: int) -> str:
    lines = ["| variant | size MB | bpw | PPL (Quantyard) | PPL (llama-perplexity) | KLD (Quantyard, exact) "
             "| KLD (llama-perplexity) | top-1 % | engine |", "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in table if "variant" in r):
        lines.append(f"| {r['variant']} | {r['size_mb']:.1f} | {fmt(r['bpw'], '.3f')} | {fmt(r.get('ppl'), '.4f')} "
                     f"| {fmt(r.get('llama_ppl'), '.4f')} | {fmt(r.get('kld'), '.5g')} "
                     f"| {fmt(r.get('llama_kld'), '.6f')} | {fmt(r.get('top1') and 100 * r['top1'], '.2f')} "
                     f"| {r.get('engine') or '—'}{''.join(mark_of(k).symbol for k in r.get('marks', []))} |")
    ref = next((r.get("ref_ppl") for r in table if r.get("ref_ppl")), None)
    lines.append("")
    lines += [f"{mk.symbol} {mk.text}" for mk in legend(k for r in table for k in r.get("marks", []))]
    lines.append(f"{windows} windows × 512 tokens of eval.txt, positions 257..511 of each scored "
                 f"({windows * 255} tokens); reference PPL {fmt(ref, '.4f')} (transformers, float32)"
                 + (f"; flow {flow_s:.0f} s" if flow_s is not None else "") + f". Note: {WEIGHTS_NOTE}.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--registry", type=Path, default=None, help="reuse (or create) this registry")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    cfg = Settings()
    checkpoint = real_checkpoint(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        registry = args.registry or Path(tmp) / "registry"
        flow_s = run_flow(registry, args.windows)
        table = rows(registry, args.windows, checkpoint, cfg, Path(tmp) / "pull")
    print(json.dumps({"flow_s": flow_s, "windows": args.windows, "rows": table}, indent=1))
    # llama-perplexity prints 6 decimals here (Mean PPL(Q)): the same number is within half a unit of its last
    # digit, or of the 4th where the ppl came from the per-chunk lines
    bad = [r["variant"] for r in table if r.get("ppl_diff") is not None and abs(r["ppl_diff"]) > 0.5e-4 + 1e-9]
    print(markdown(table, flow_s, args.windows))
    if bad:
        raise SystemExit(f"PPL differs from llama-perplexity's beyond its 4 printed decimals: {bad}")


if __name__ == "__main__":
    main()
