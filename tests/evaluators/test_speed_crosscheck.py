"""Quantyard's llama.cpp speed against llama.cpp's own benchmarks of the same build, on the same GGUF, machine and
threads, in the same test: llama-bench for batch 1 (prompt tok/s, decode tok/s at the prompt's depth, TTFT =
the prompt's time) and llama-batched-bench for N concurrent sequences, their numbers converted to Quantyard's
definitions (evaluators/speed.py, evaluators/llamacpp/reference_tools.py).

The two sides run back to back, ``ROUNDS`` times, each measuring ``REPEATS`` times, at the CPU-scaled shape the
product records (128 prompt / 32 generated tokens; N = 1 and 8 at 64 / 32). What is compared is each side's best
repetition (the highest rate, the shortest TTFT): foreign load only ever slows a run down, so on a shared
machine the best of 40 repetitions is each side's least disturbed figure, where the medians follow the other
jobs' load (see :data:`TOLERANCE`). One thread on both sides: with two threads on a 2-core machine any other
process makes llama.cpp's OpenMP threads wait for a descheduled peer: per-round ratios ranged 0.1-25 at
load 3-5 (measured); the thread count changes no definition.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evaluators.llamacpp.reference_tools import crosscheck
from pipeline.config import Settings
from pipeline.plan import EvalSpec, SpeedSpec
from registry import open_registry

ROUNDS, REPEATS, PARALLEL, THREADS = 8, 5, (1, 8), 1
#: Largest accepted |ours / theirs − 1| of the best repetitions. Both sides decode the same batches with the same
#: ggml kernels, so the expected ratio is 1 less the Python work per decode step in Quantyard's runner (a ctypes
#: call, a numpy view and an argmax: 10-15 µs of a 0.2 ms demo-model step, so decode ratios sit at 0.82-0.94 on the
#: demo model, 0.95-1.1 on the real one). Measured with this test's configuration, six runs on this project's 2-core
#: AVX-512 machine while other jobs ran (load 3.2-3.6): best-of ratios 0.82-1.15 over all metrics;
#: bench/results/speed_crosscheck.txt (load 2-3): 0.87-1.08 on the demo GGUFs, 0.93-1.03 on the real checkpoint.
#: Under heavier foreign load (4.5-6, three jobs) single ratios fell to 0.6, and beside the other xdist worker's
#: tests to 0.68-0.75 (CI, 2026-12-03: decode-only N=1 0.747, every decode ratio 0.71-1.10): the test is marked
#: ``alone``, so under ``make test`` the other worker pauses while it runs. A definition error moves a ratio by more
#: than 25 %: prompt tokens counted as generated (batched-bench's own ``speed``) by ×3, the prefill left out of the
#: aggregate by ×1.5; the smallest, a missing −1 in decode tok/s, is ×32/31 and is pinned by the unit tests
#: (test_speed.py).
TOLERANCE = 0.25


@pytest.mark.alone
def test_llamacpp_speed_agrees_with_llama_bench_and_batched_bench(tmp_path: Path, demo_registry_template: dict,
                                                                   cache_dir: Path) -> None:
    cfg = Settings(cache_dir=cache_dir, threads=THREADS)
    gguf = open_registry(str(demo_registry_template["registry"])).link_files("demo/Q4_K_M", tmp_path / "m")[0]
    spec = EvalSpec(speed=SpeedSpec(repeats=REPEATS, parallel=PARALLEL))
    rows = crosscheck(cfg, gguf, spec, ROUNDS, tmp_path)
    assert [r["metric"] for r in rows][:3] == ["pp tok/s", "tg tok/s", "TTFT ms"]
    assert len(rows) == 3 + 2 * len(PARALLEL) and all(len(r["ratios"]) == ROUNDS for r in rows)
    bad = _outside(rows)
    if bad:
        # A timing excursion does not repeat; a definition error (×1.5 and more, above) does. Seen in a full
        # `make test` on the 2-core AMD EPYC VM (2026-12-07): decode-only aggregate N=8 at 1.297, per-round ratios
        # 0.70-1.69, while the same test alone read within ±25 %. So a metric fails when a second measurement,
        # made at once, is outside the tolerance too.
        again = tmp_path / "again"
        again.mkdir()
        second = _outside(crosscheck(cfg, gguf, spec, ROUNDS, again))
        bad = {m: (r, second[m]) for m, r in bad.items() if m in second}
    assert not bad, f"ours / llama.cpp's tools (best repetitions) outside ±{TOLERANCE:.0%} twice: {bad} (all: {rows})"


def _outside(rows: list[dict]) -> dict[str, float]:
    """The metrics whose best-repetition ratio is outside the tolerance, with that ratio."""
    return {r["metric"]: round(r["best_ratio"], 3) for r in rows if abs(r["best_ratio"] - 1.0) > TOLERANCE}
