"""Every statistic ``llama-perplexity --kl-divergence`` prints, beside Quantyard's, field by field, on the same GGUF
files and the same positions (``--model``: demo, real or a checkpoint folder; the F16 base as llama.cpp's reference
on both sides, the second half of each 512-token chunk scored). tests/evaluators/test_llama_perplexity_fields.py
runs the same comparison as a test.

How close they must be: within 1 % of llama-perplexity's value, or its printed precision, plus what
llama-perplexity's own base rounding accounts for. Its base is stored as 16-bit log-probs over 16 nats below each
position's top, with everything below clipped; Quantyard's reference keeps float32 target log-probs and a finer grid
(evaluators/metrics.py). How much that moves each printed field is measured, not assumed: llama-perplexity run on the
F16 base itself against its own stored base (where every statistic would be exactly 0, or 1 for a ratio, without the
rounding) prints, field by field, what the rounding alone produces; that deviation is the allowance. Quantyard's F16
against its reference gives its own (much smaller) grid noise, added likewise.

Usage: python bench/llama_fields.py [--model demo] [--model real] [--windows 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evaluators.llamacpp.crosscheck import kl_divergence, save_base
from pipeline.config import Settings
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.plan import EvalSpec, GGUFOptions, Plan, SourceInput, SpeedSpec, variants_from_flags
from registry import open_registry

#: Its variants: F16 (the rounding's allowance) and three quantized ones.
TYPES = "F16,Q8_0,Q4_K_M,Q2_K"


def run(source: Path, tmp: Path, cfg: Settings, windows: int, name: str, text: Path | None = None,
        ) -> dict[str, tuple[dict[str, Any], dict[str, tuple[float, float]]]]:
    """Quantyard's flow (a llama.cpp F16 reference) and llama-perplexity on the same files and chunks: per
    variant, (Quantyard's quality metrics, llama-perplexity's printed statistics as (value, printed half-unit))."""
    from flows.quantize import convert_flow

    text = text or source / "eval.txt"
    plan = Plan(source=SourceInput(source=str(source)), model_name=name,
                variants=variants_from_flags(gguf=TYPES), gguf=GGUFOptions(base_type="F16"),
                eval=EvalSpec(window=512, stride=512, score_from=257, max_windows=windows, text_file=str(text),
                              reference_engine="llama.cpp", reference_dtype="float16", noise_floor=False,
                              speed=SpeedSpec(enabled=False)))
    report = convert_flow(plan, cfg)
    assert report.ok, [v.error or v.eval_error for v in report.variants]
    tools = llama_cpp_toolchain(cfg)
    base = next(cfg.work_root.rglob("gguf-base/**/*-F16.gguf"))
    save_base(tools, base, text, tmp / "base.kld", ctx=512, chunks=windows, threads=cfg.threads)
    reg = open_registry(cfg)
    out = {}
    for v in report.variants:
        (gguf,) = [p for p in reg.pull(str(v.ref), tmp / "pull" / v.variant) if p.suffix == ".gguf"]
        out[v.variant] = (v.quality or {}, kl_divergence(tools, gguf, tmp / "base.kld", threads=cfg.threads).stats)
    return out


#: What each field is when a model is compared with itself (rounding aside).
IDEAL = {"ppl_ratio": 1.0, "ln_ppl_cor": 1.0}
#: Fields that do not read the base's rounded log-probs: the variant's own NLL, which both sides compute alike.
OWN = ("ppl", "ppl_unc", "top1_agreement", "top1_agreement_unc")


def allowance(key: str, theirs_f16: dict[str, tuple[float, float]], ours_f16: dict[str, Any]) -> float:
    """What the two sides' rounding accounts for in ``key`` (module docstring): each side's F16-against-its-own-base
    deviation from the ideal value. A percentile's deviation is bounded by the largest per-position one."""
    if key in OWN:
        return 0.0
    family = "kld" if key.startswith("kld_") and "unc" not in key else "delta_p" if key.startswith("delta_p_") \
        and "unc" not in key and "rms" not in key else None
    if family is not None:  # a percentile moves by at most the largest noise of one position
        keys = [k for k in theirs_f16 if k.startswith(f"{family}_") and "unc" not in k and "rms" not in k]
        theirs = max(abs(theirs_f16[k][0]) for k in keys)
        ours = max(abs(float(ours_f16.get(k) or 0.0)) for k in keys)
        return theirs + ours
    ideal = IDEAL.get(key, 0.0)
    theirs = abs(theirs_f16[key][0] - ideal) if key in theirs_f16 else 0.0
    ours = abs(float(ours_f16.get(key, ideal)) - ideal)
    if key in ("ref_ppl", "ppl_diff", "ppl_diff_unc", "ref_ppl_unc"):  # in PPL units: the base's shift, scaled
        shift = abs(theirs_f16["ppl"][0] - theirs_f16["ref_ppl"][0]) + abs(theirs_f16["ref_ppl_unc"][0] -
                                                                         float(ours_f16["ref_ppl_unc"]))
        return shift + theirs + ours
    return theirs + ours


def check(results: dict[str, Any]) -> list[str]:
    ours_f16, theirs_f16 = results["F16"]
    problems = []
    for variant, (ours, theirs) in results.items():
        if variant == "F16":
            continue
        assert set(theirs) >= {"ppl", "kld_mean", "kld_min"}, theirs
        for key, (value, half) in theirs.items():
            mine = ours.get(key)
            assert mine is not None, f"{variant}: Quantyard has no {key}"
            limit = max(0.01 * abs(value), half) + allowance(key, theirs_f16, ours_f16)
            if not math.isfinite(float(mine)) or abs(float(mine) - value) > limit:
                problems.append(f"{variant} {key}: Quantyard {mine:.6g}, llama-perplexity {value:.6g} "
                                f"(allowed {limit:.3g})")
    return problems



def table(name: str, results: dict[str, Any]) -> str:
    """Every printed field of every quantized variant: llama-perplexity's value, Quantyard's, the difference and
    what is allowed (module docstring)."""
    ours_f16, theirs_f16 = results["F16"]
    lines = [f"### {name}: every field llama-perplexity --kl-divergence prints", "",
             "| variant | field | llama-perplexity | Quantyard | relative difference | allowed | ok |",
             "|---|---|---:|---:|---:|---:|---|"]
    for variant, (ours, theirs) in results.items():
        if variant == "F16":
            continue
        for key, (value, half) in theirs.items():
            mine = float(ours[key])
            limit = max(0.01 * abs(value), half) + allowance(key, theirs_f16, ours_f16)
            rel = abs(mine - value) / abs(value) if value else float("nan")
            ok = math.isfinite(mine) and abs(mine - value) <= limit
            lines.append(f"| {variant} | {key} | {value:.6g} | {mine:.6g} | {rel:.2%} | {limit:.3g} | "
                         f"{'yes' if ok else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    from pipeline.cli.common import prefect_defaults

    prefect_defaults()  # before Prefect is imported: no telemetry
    import pipeline_vs_llamacpp as vs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="demo, real or a checkpoint folder (repeatable)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    base_cfg = Settings()
    parts = [vs.header(sys.argv, os.getloadavg(), base_cfg.threads)]
    verdicts = []
    for name in args.model or ["demo", "real"]:
        ckpt = vs.checkpoint(name, base_cfg)
        base_cfg.work_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=base_cfg.work_root, prefix="bench-fields-") as tmp:
            cfg = Settings(registry=str(Path(tmp) / "registry"), work_dir=Path(tmp) / "work",
                           cache_dir=base_cfg.cache_dir, threads=base_cfg.threads)
            text = ckpt / "eval.txt" if (ckpt / "eval.txt").is_file() else None
            if text is None:
                text, _ = vs.eval_text_file(ckpt, None, Path(tmp))
            results = run(ckpt, Path(tmp), cfg, args.windows, name, text)
            problems = check(results)
            fields = sum(len(theirs) for variant, (_, theirs) in results.items() if variant != "F16")
            parts.append(table(f"{name} ({ckpt}, {args.windows} chunks of 512)", results))
            verdicts.append(f"- {name}: {fields} printed fields of {len(results) - 1} quantized variants; "
                            + ("every one within its allowance" if not problems else
                               f"{len(problems)} OUTSIDE their allowance: " + "; ".join(problems)))
            print(parts[-1] + "\n\n" + verdicts[-1] + "\n", flush=True)
    parts.append("### verdicts\n\n" + "\n".join(verdicts))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
