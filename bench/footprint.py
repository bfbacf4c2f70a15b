"""The pre-flight's memory ESTIMATES (pipeline/footprint.py, flows/preflight.py) beside what each stage measured.

For each checkpoint (``--model``: demo, real, big, 8b or a folder), either run ``quantyard convert`` on a fresh
registry (``--gguf``, ``--awq``, ``--max-windows``, ``--window``; no speed) and read its report, or read the report
of a run already made (``--report FILE``: ``quantyard convert ... --json`` output; a re-run decided from the stage
ledger has every stage's usage too). Then the plan's estimates are computed on this machine as the pre-flight
computes them (flows/preflight.py ``preflight``), and printed beside each stage's measured peak of its own memory
(pipeline/resources.py: RssAnon + RssShmem of the stage's processes; a memory-mapped model file does not count)
(AWQ: group size 64, 16 calibration samples of 128 tokens, so that SmolLM2's 576-wide layers take it)
and the machine's memory in use at its peak.

An estimate is meant to be at least the measurement (it decides what is refused before any work); the ratio column
says by how much it is over (> 1) or under (< 1).

Usage: python bench/footprint.py [--model demo] [--gguf Q8_0,Q4_K_M] [--awq] [--max-windows 4] [--window 512]
[--report FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_vs_llamacpp as vs

from converters.checkpoint import load_checkpoint
from flows.preflight import estimate_of, preflight
from pipeline.config import Settings
from pipeline.plan import AWQSpec, EvalSpec, Plan, SourceInput, SpeedSpec, variants_from_flags
from pipeline.resources import gib
from pipeline.specs import SourceKind, SourceRef


def plan_of(ckpt: Path, gguf: str, awq: bool, max_windows: int, window: int, exl2: str | None = None) -> Plan:
    extra = (AWQSpec(calibration_samples=16, calibration_seq_len=128, group_size=64),) if awq else ()
    return Plan(source=SourceInput(source=str(ckpt)), model_name="bench",
                variants=(*variants_from_flags(gguf=gguf, exl2=exl2), *extra),
                eval=EvalSpec(max_windows=max_windows, window=window, stride=window, speed=SpeedSpec(enabled=False)))


def run(ckpt: Path, cfg: Settings, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``quantyard convert`` on a fresh registry; its JSON report."""
    cmd = [sys.executable, "-m", "pipeline.cli", "convert", str(ckpt), "--name", "bench", "--gguf", args.gguf,
           "--max-windows", str(args.max_windows), "--window", str(args.window), "--stride", str(args.window),
           "--registry", str(work / "registry"), "--no-speed", "--json"]
    if args.awq:
        cmd += ["--awq", "--awq-calibration-samples", "16", "--awq-calibration-seq-len", "128",
                "--awq-group-size", "64"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=vs.fresh_env(cfg, work), cwd=vs.REPO)
    if res.returncode != 0:
        raise SystemExit(f"quantyard convert exited {res.returncode}: {(res.stdout + res.stderr)[-3000:]}")
    return dict(json.loads(res.stdout))


def table(name: str, ckpt: Path, report: dict[str, Any], needs: list[dict[str, Any]]) -> str:
    out = [f"### {name} ({ckpt})", "",
           "| stage | measured own peak | ESTIMATE | estimate / measured | machine in use (peak) | seconds |",
           "|---|---:|---:|---:|---:|---:|"]
    for stage in report["stages"]:
        usage = stage.get("usage") or {}
        own = usage.get("peak_process_bytes")
        if own is None:
            continue
        est = estimate_of(stage["stage"], needs)
        ratio = f"{est / own:.1f}" if est is not None and own > 0 else "—"
        out.append(f"| {stage['stage']} | {gib(own)} | {gib(est)} | {ratio} | {gib(usage.get('peak_in_use_bytes'))} "
                   f"| {usage.get('wall_s', 0):.1f} |")
    return "\n".join(out)


def decisions(name: str, ckpt: Path, flight: Any) -> str:
    """What the pre-flight decided for a plan on this machine: every estimate, the reference and the refusals."""
    d = flight.as_dict()
    out = [f"### {name} ({ckpt}): the pre-flight's decisions", "", f"- memory: {flight.memory.describe()}",
           f"- reference: {d['reference']}", ""]
    out += ["| stage | ESTIMATE | fits |", "|---|---:|---|"]
    out += [f"| {n['stage'] or n['what']} ({n['what']}) | {gib(n['memory'])} | {'yes' if n['fits'] else 'NO'} |"
            for n in d["needs"]]
    out += ["", *(f"- refused: {fmt}: {why}" for fmt, why in d["refused"].items()),
            *(f"- disk: {k['where']}: needs {gib(k['needed'])} (ESTIMATE), {gib(k['free'])} free" for k in d["disk"]),
            *(f"- variants kept: {', '.join(str(v.name) for v in flight.plan.variants)}",)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="demo, real, 8b or a checkpoint folder (repeatable)")
    ap.add_argument("--gguf", default="Q8_0,Q4_K_M")
    ap.add_argument("--awq", action="store_true")
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--exl2", default=None, help="EXL2 bits per weight to plan too (with --plan-only)")
    ap.add_argument("--plan-only", action="store_true",
                    help="only the pre-flight's decisions for this plan on this machine (nothing runs)")
    ap.add_argument("--report", type=Path, help="the JSON report of a run already made (one --model)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = Settings()
    parts = [vs.header(sys.argv, os.getloadavg(), cfg.threads)]
    for name in args.model or ["demo"]:
        ckpt = vs.checkpoint(name, cfg)
        plan = plan_of(ckpt, args.gguf, args.awq, args.max_windows, args.window, args.exl2)
        source = SourceRef(kind=SourceKind.LOCAL, path=str(ckpt), content_hash="footprint")
        checkpoint = load_checkpoint(ckpt, scan_values=False)
        flight = preflight(plan, checkpoint, source, cfg, check=lambda fmt, specs: None)
        needs = flight.as_dict()["needs"]
        if args.plan_only:
            parts.append(decisions(name, ckpt, flight))
            print(parts[-1] + "\n", flush=True)
            continue
        if args.report is not None:
            report = json.loads(args.report.read_text())
        else:
            cfg.work_root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cfg.work_root, prefix="bench-footprint-") as tmp:
                report = run(ckpt, cfg, Path(tmp), args)
        parts.append(table(name, ckpt, report, needs))
        parts.append(f"- reference: {(report.get('reference') or {}).get('engine')} "
                     f"{(report.get('reference') or {}).get('dtype')}; {flight.memory.describe()} when estimated")
        print(parts[-2] + "\n" + parts[-1] + "\n", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
