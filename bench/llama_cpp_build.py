"""How long the llama-cpp-python wheel takes to build as Quantyard builds it, against the plain build, and whether
the two compute the same numbers.

Both from the pinned sdist (``scripts/bootstrap_llama_cpp.py``), on this machine, one after the other, with every
core (``CMAKE_BUILD_PARALLEL_LEVEL``), with the same compiler flags:

* plain: the sdist as it is, every llama.cpp tool, one compile per source file (the bootstrap's build until
  2026-12-02);
* quantyard: the bootstrap's build: ``DROPPED_TOOLS`` left out, a CMake unity build (``UNITY_SKIP`` compiled
  alone).

Then each build's ``llama-perplexity`` on the demo checkpoint's F16 GGUF (made once with the cached converter) and
its ``eval.txt``: a unity build changes how sources are grouped into compiles, which can change inlining and so
floating-point contraction; the two final estimates are printed side by side and must agree to every digit.

Usage: python bench/llama_cpp_build.py [--ctx 128] [--chunks 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: a script's own folder

from pipeline_vs_llamacpp import REPO, checkpoint, header

from pipeline.config import Settings
from pipeline.llama_cpp import llama_cpp_toolchain

PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def bootstrap() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bootstrap_llama_cpp", REPO / "scripts" / "bootstrap_llama_cpp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(mod: ModuleType, sdist: Path, way: str, tmp: Path) -> tuple[float, Path, list[str]]:
    """Build the wheel ``way`` (plain | quantyard: the bootstrap's ``build_wheel``) under ``tmp``; its wall
    seconds, the folder it was unpacked into and its tool binaries."""
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    wheel = mod.build_wheel(sdist, tmp, sys.executable, tmp / "build.log", quantyard=way == "quantyard")
    wall = time.perf_counter() - t0
    unpacked = tmp / "wheel"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    tools = sorted(p.name for p in (unpacked / "bin").iterdir())
    for p in (unpacked / "bin").iterdir():
        p.chmod(0o755)
    return wall, unpacked, tools


def perplexity(unpacked: Path, gguf: Path, text: Path, ctx: int, chunks: int) -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=str(unpacked / "lib"))
    res = subprocess.run([str(unpacked / "bin" / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
                          "--chunks", str(chunks), "-t", str(os.cpu_count() or 1)],
                         capture_output=True, text=True, env=env)
    m = PPL.search(res.stdout + res.stderr)
    if res.returncode != 0 or not m:
        raise RuntimeError(f"llama-perplexity exited {res.returncode}: {(res.stdout + res.stderr)[-2000:]}")
    return f"{m.group(1)} +/- {m.group(2)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load = os.getloadavg()
    mod = bootstrap()
    cfg = Settings()
    sdist = mod.ensure_sdist(mod.cache_root())
    ckpt = checkpoint("demo", cfg)
    tools = llama_cpp_toolchain(cfg)
    rows: list[tuple[str, float, int, str]] = []
    with tempfile.TemporaryDirectory(dir=mod.cache_root(), prefix="bench-build-") as tmp_s:
        tmp = Path(tmp_s)
        gguf = tmp / "demo-F16.gguf"
        subprocess.run([sys.executable, str(tools.converter), str(ckpt), "--outtype", "f16", "--outfile", str(gguf)],
                       check=True, capture_output=True, env=tools.converter_env())
        for way in ("plain", "quantyard"):
            print(f"[{way}] building ...", file=sys.stderr, flush=True)
            wall, unpacked, bins = build(mod, sdist, way, tmp / way)
            rows.append((way, wall, len(bins), perplexity(unpacked, gguf, ckpt / "eval.txt", args.ctx, args.chunks)))
    plain, ours = rows
    lines = [header(sys.argv, load, os.cpu_count() or 1),
             f"# llama-cpp-python {mod.VERSION} wheel from the pinned sdist; compiler flags: "
             f"{mod.compile_flags() or '(none beyond -march=native)'}",
             f"# perplexity: each build's llama-perplexity, demo checkpoint F16 GGUF, eval.txt, -c {args.ctx} "
             f"--chunks {args.chunks}", "",
             "| build | wall s | tool binaries | llama-perplexity PPL |", "|---|---|---|---|"]
    lines += [f"| {way} | {wall:.1f} | {n} | {ppl} |" for way, wall, n, ppl in rows]
    lines += ["", f"quantyard / plain build time: {ours[1] / plain[1]:.3f}",
              f"same perplexity to every printed digit: {'yes' if ours[3] == plain[3] else 'NO'}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
