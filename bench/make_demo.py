"""``make demo`` run as a newcomer runs it, timed, its output kept as a result file (README.md shows its table).

``--fresh`` points every cache at empty folders first (``XDG_CACHE_HOME``: Quantyard's environments, llama.cpp's
build, the demo checkpoint, pip's and Hugging Face's caches; ``XDG_DATA_HOME``: the registry; ``PREFECT_HOME``), so
everything is built from nothing but the package registries (and, where this machine has them, pip's configured
local wheel folders: the file says which). Without it, only the registry is new (the caches are warm): what a
second project on the same machine sees.

The file: a header (command, commit, CPU, date, what was empty), the wall time, then the command's output, whose
last table is the demo's results (rendered into README.md by scripts/docs.py).

Usage: python bench/make_demo.py [--fresh] [--out bench/results/make_demo_<machine>_<date>.txt]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.cpu import cpu_flags  # noqa: E402


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()


def pip_local_sources() -> str:
    """What pip may install from besides PyPI on this machine (its configured find-links and extra indexes)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    lines = [ln for ln in out.splitlines() if "find-links" in ln or "extra-index-url" in ln or "index-url" in ln]
    return "; ".join(lines) or "none configured"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh", action="store_true", help="every cache empty (module docstring)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    now = datetime.now(UTC)
    with tempfile.TemporaryDirectory(prefix="make-demo-") as tmp:
        env = dict(os.environ, XDG_DATA_HOME=f"{tmp}/data")
        empty = "the registry (XDG_DATA_HOME)"
        if args.fresh:
            env.update(XDG_CACHE_HOME=f"{tmp}/cache", PREFECT_HOME=f"{tmp}/prefect", PIP_NO_CACHE_DIR="1")
            empty = ("the registry, Quantyard's caches (environments, llama.cpp build, demo checkpoint), pip's cache "
                     "(PIP_NO_CACHE_DIR), Hugging Face's and Prefect's (XDG_DATA_HOME, XDG_CACHE_HOME, PREFECT_HOME); "
                     f"not empty: .venv if present, and pip's local sources: {pip_local_sources()}")
        t0 = time.perf_counter()
        done = subprocess.run(["make", "demo"], cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--", "pipeline", "flows", "converters",
                                                 "evaluators", "registry") else ""
    head = [f"# command: make demo{' (fresh: every cache empty)' if args.fresh else ' (a new registry, warm caches)'}",
            f"# commit: {_git('rev-parse', '--short', 'HEAD')}{dirty}",
            f"# CPU: {cpu}, {os.cpu_count()} cores, ISA flags: {cpu_flags()}",
            f"# date: {now.strftime('%Y-%m-%d %H:%M UTC')}",
            f"# empty at the start: {empty}",
            f"# exit status {done.returncode}"]
    lines = done.stdout.rstrip().splitlines()
    start = next((i - 1 for i, ln in enumerate(lines) if ln.lstrip().startswith("┏")), 0)
    body = ["", "### wall time", "", f"make demo: {wall:.1f} s ({wall / 60:.1f} min)", "", "### demo results", "",
            "```", *lines[max(0, start):], "```", "", "### setup output", "", "```", *lines[:max(0, start)], "```"]
    text = "\n".join(head + body) + "\n"
    print(text)
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
    machine = "avx512" if "avx512f" in cpu_flags() else "avx2"
    out = args.out or REPO / "bench" / "results" / f"make_demo_{'fresh_' if args.fresh else ''}{machine}_" \
                                                   f"{now:%Y-%m-%d}.txt"
    out.write_text(text)
    raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
