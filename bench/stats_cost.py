"""What llama-perplexity's full statistics, the confidence bands and the tail intervals add to an evaluation's time.

Two measurements on one checkpoint (``--model``, default the real one), one GGUF type (``--gguf``, default Q4_K_M):

1. **before and after**: ``quantyard convert`` on a fresh registry, once with the code at ``--before`` (a commit
   without these statistics, checked out in a temporary git worktree) and once with the code here, alternately,
   ``--repeats`` times each; the evaluate stage's wall time of each run (its StageRecord usage) and the ratio of
   the medians. The noise floor is off on both sides (``--no-noise-floor``: it is a run of its own, once per
   source and reference, not part of an evaluation).
2. **their own time**: each result of the code here records ``statistics_s`` (evaluators/metrics.py ``compare``:
   the time spent on exactly these additions), as a share of that evaluation's wall time.

The before/after ratio is bounded below by the noise between two identical evaluations; the second measurement is
the direct one.

Usage: python bench/stats_cost.py [--model real] [--gguf Q4_K_M] [--max-windows 8] [--repeats 3]
[--before COMMIT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_vs_llamacpp as vs

from pipeline.config import Settings


def convert(code: Path, ckpt: Path, cfg: Settings, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``quantyard convert --json`` with the code in ``code`` on a fresh registry; its report."""
    cmd = [cfg.core_python, "-m", "pipeline.cli", "convert", str(ckpt), "--name", "bench", "--gguf", args.gguf,
           "--max-windows", str(args.max_windows), "--registry", str(work / "registry"), "--no-speed", "--json",
           "--reference-engine", "transformers"]
    env = {**vs.fresh_env(cfg, work), "PYTHONPATH": str(code)}
    if (code / "pipeline" / "cli" / "convert.py").read_text().count("--no-noise-floor"):
        cmd.append("--no-noise-floor")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code)
    if res.returncode != 0:
        raise SystemExit(f"quantyard convert ({code}) exited {res.returncode}: {(res.stdout + res.stderr)[-3000:]}")
    return dict(json.loads(res.stdout))


def evaluate_wall(report: dict[str, Any]) -> float:
    """The evaluate stage's wall time of a one-variant report."""
    (stage,) = [s for s in report["stages"] if s["stage"].startswith("evaluate:") and s["status"] == "ran"]
    return float(stage["usage"]["wall_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="real")
    ap.add_argument("--gguf", default="Q4_K_M")
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default="b64769f", help="a commit without the statistics (default: the last one)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = Settings()
    ckpt = vs.checkpoint(args.model, cfg)
    lines = [vs.header(sys.argv, os.getloadavg(), cfg.threads), "",
             f"### statistics cost: {args.model} ({ckpt}), {args.gguf}, {args.max_windows} windows", ""]
    before_walls: list[float] = []
    after_walls: list[float] = []
    shares: list[float] = []
    cfg.work_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cfg.work_root, prefix="bench-stats-") as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=vs.REPO, check=True,
                       capture_output=True)
        try:
            lines += ["| repeat | before: evaluate s | after: evaluate s | after: statistics s | share |",
                      "|---:|---:|---:|---:|---:|"]
            for i in range(args.repeats):
                first, second = (old, vs.REPO) if i % 2 == 0 else (vs.REPO, old)
                walls = {}
                for code in (first, second):
                    report = convert(code, ckpt, cfg, Path(tmp) / f"{i}-{code.name}", args)
                    walls[code] = (evaluate_wall(report), report)
                before, _ = walls[old]
                after, report = walls[vs.REPO]
                spent = float(report["variants"][0]["quality"]["statistics_s"])
                before_walls.append(before)
                after_walls.append(after)
                shares.append(spent / after)
                lines.append(f"| {i + 1} | {before:.2f} | {after:.2f} | {spent:.4f} | {100 * spent / after:.2f} % |")
                print(lines[-1], flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=vs.REPO, capture_output=True)
    b, a = statistics.median(before_walls), statistics.median(after_walls)
    lines += ["", f"- evaluate stage, median of {args.repeats}: before ({args.before}) {b:.2f} s, after {a:.2f} s, "
              f"ratio after/before {a / b:.3f}",
              f"- the statistics' own time, median of {args.repeats}: {100 * statistics.median(shares):.2f} % of "
              f"the evaluation's wall time (limit: 2 %)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
