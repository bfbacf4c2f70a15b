"""The README's real-checkpoint table: `quantyard demo --real` on SmolLM2-135M-Instruct, and beside every GGUF
row the perplexity `llama-perplexity` (same llama.cpp build) computes on the same file and the same scored
positions: 512-token chunks of the checkpoint's eval.txt, second half of each chunk scored, which is what
`--score-from 257` makes Quantyard score. The two must agree to 4 decimals (llama-perplexity prints 4).

Usage: python bench/real_model.py [--windows 64] [--registry DIR] [--markdown]

The flow runs as the documented command, in a subprocess, and is timed; with an existing --registry it
reuses what is there (a second run takes seconds). The checkpoint's weights are dequantized from a Q4_1
GGUF (pipeline/real_model.py): every number is kinder than on the original release.
KLD here is Quantyard's top-32 + tail bin estimate, a lower bound of the full-vocabulary KLD that
`llama-perplexity --kl-divergence` reports (see evaluators/metrics.py); it is labelled so in the output.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flows.steps import real_checkpoint
from pipeline.config import Settings
from pipeline.llama_cpp import LlamaCppToolchain, llama_cpp_toolchain
from pipeline.real_model import WEIGHTS_NOTE
from registry import open_registry

MODEL = "smollm2-135m"


def llama_perplexity(tools: LlamaCppToolchain, model: Path, text: Path, ctx: int, chunks: int, threads: int) -> float:
    """The final PPL llama-perplexity prints; its asynchronous logger can drop the last line, so a run
    without it is repeated (at most 3 times)."""
    cmd = [str(tools.exe("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(ctx),
           "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads), "-tb", str(threads)]
    out = ""
    for _ in range(3):
        res = subprocess.run(cmd, capture_output=True, text=True, env=tools.env(), check=True, timeout=3600)
        out = res.stdout + res.stderr
        found = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
        if found:
            return float(found.group(1))
    raise SystemExit("llama-perplexity printed no final estimate in 3 runs:\n" + out[-2000:])


def run_flow(registry: Path, windows: int) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pipeline.cli", "demo", "--real", "--windows", str(windows),
           "--registry", str(registry)]
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def rows(registry: Path, windows: int, checkpoint: Path, cfg: Settings, work: Path) -> list[dict[str, Any]]:
    reg = open_registry(str(registry), create=False)
    tools = llama_cpp_toolchain(cfg)
    out = []
    order = {"gguf": 0, "awq": 1, "exl2": 2}
    views = sorted(reg.latest_versions(MODEL), key=lambda v: (order.get(v.format, 9), -v.size))
    for view in views:
        quality = next((r for r in view.results if r.kind == "quality" and r.status == "ok"), None)
        speed = next((r for r in view.results if r.kind == "speed" and r.status == "ok"), None)
        row: dict[str, Any] = {"variant": view.variant, "format": view.format, "size_mb": view.size / 1e6,
                               "bpw": (view.lineage.get("info") or {}).get("bpw"),
                               "engine": quality.engine if quality else None}
        if quality:
            m = quality.metrics
            row.update({"ppl": m["ppl"], "ref_ppl": m.get("ref_ppl"), "kld_top32_bound": m.get("kld_mean"),
                        "top1": m.get("top1_agreement"), "n_tokens": m.get("n_tokens"),
                        "dtype": m.get("dtype"), "kernel": m.get("wna16_kernel")})
        if speed:
            pp, tg = speed.metrics.get("prompt_tok_per_s"), speed.metrics.get("decode_tok_per_s")
            row.update({"pp_tok_s": pp.get("median") if isinstance(pp, dict) else pp,
                        "tg_tok_s": tg.get("median") if isinstance(tg, dict) else tg})
        if view.format == "gguf":
            (path,) = [p for p in reg.pull(view.ref, work / view.variant) if p.suffix == ".gguf"]
            t0 = time.perf_counter()
            row["llama_perplexity_ppl"] = llama_perplexity(tools, path, checkpoint / "eval.txt", 512, windows,
                                                           cfg.threads)
            row["llama_perplexity_s"] = time.perf_counter() - t0
            row["ppl_diff"] = row["ppl"] - row["llama_perplexity_ppl"] if quality else None
        out.append(row)
    return out


def fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(table: list[dict[str, Any]], flow_s: float | None, windows: int) -> str:
    lines = ["| variant | size MB | bpw | PPL (Quantyard) | PPL (llama-perplexity) | KLD (top-32 bound) | top-1 % "
             "| pp tok/s | tg tok/s | engine |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['variant']} | {r['size_mb']:.1f} | {fmt(r['bpw'], '.3f')} | {fmt(r.get('ppl'), '.4f')} "
                     f"| {fmt(r.get('llama_perplexity_ppl'), '.4f')} | {fmt(r.get('kld_top32_bound'), '.3g')} "
                     f"| {fmt(r.get('top1') and 100 * r['top1'], '.2f')} | {fmt(r.get('pp_tok_s'), ',.0f')} "
                     f"| {fmt(r.get('tg_tok_s'), ',.1f')} | {r.get('engine') or '—'} |")
    ref = next((r.get("ref_ppl") for r in table if r.get("ref_ppl")), None)
    lines.append("")
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
    # llama-perplexity rounds to 4 decimals: the same number is within half a unit of its last digit
    bad = [r["variant"] for r in table if r.get("ppl_diff") is not None and abs(r["ppl_diff"]) > 0.5e-4 + 1e-9]
    print(markdown(table, flow_s, args.windows))
    if bad:
        raise SystemExit(f"PPL differs from llama-perplexity's beyond its 4 printed decimals: {bad}")


if __name__ == "__main__":
    main()
