"""Quantyard's llama.cpp speed against llama.cpp's own benchmarks of the same build, on the same GGUF, machine and
threads, in the same test: llama-bench for batch 1 (prompt tok/s, decode tok/s at the prompt's depth, TTFT =
the prompt's time) and llama-batched-bench for N concurrent sequences, their numbers converted to Quantyard's
definitions (evaluators/speed.py, evaluators/llamacpp/reference_tools.py).

The two sides run back to back, ``ROUNDS`` times, each measuring ``REPEATS`` times; what is compared is the median
over the rounds of ours / theirs (each side's median of its repeats). ``TOLERANCE``: see :data:`TOLERANCE`.
"""

from __future__ import annotations

from pathlib import Path

from evaluators.llamacpp.reference_tools import crosscheck
from pipeline.config import Settings
from pipeline.plan import EvalSpec, SpeedSpec
from registry import open_registry

ROUNDS, REPEATS, PARALLEL = 3, 5, (1, 8)
#: Largest accepted |ours / theirs − 1|. Both sides decode the same batches with the same ggml kernels, so the
#: expected ratio is 1 up to Python's per-step overhead (a ctypes call and an argmax per token) and noise.
#: Measured on a 2-core machine shared with other jobs: see bench/results/speed_crosscheck.txt.
TOLERANCE = 0.25


def test_llamacpp_speed_agrees_with_llama_bench_and_batched_bench(tmp_path: Path, demo_registry_template: dict,
                                                                   cache_dir: Path) -> None:
    cfg = Settings(cache_dir=cache_dir, threads=2)
    gguf = open_registry(str(demo_registry_template["registry"])).link_files("demo/Q4_K_M", tmp_path / "m")[0]
    spec = EvalSpec(speed=SpeedSpec(repeats=REPEATS, parallel=PARALLEL))
    rows = crosscheck(cfg, gguf, spec, ROUNDS, tmp_path)
    assert [r["metric"] for r in rows][:3] == ["pp tok/s", "tg tok/s", "TTFT ms"]
    assert len(rows) == 3 + 2 * len(PARALLEL) and all(len(r["ratios"]) == ROUNDS for r in rows)
    bad = {r["metric"]: round(r["ratio"], 3) for r in rows if abs(r["ratio"] - 1.0) > TOLERANCE}
    assert not bad, f"ours / llama.cpp's tools outside ±{TOLERANCE:.0%}: {bad} (all: {rows})"
