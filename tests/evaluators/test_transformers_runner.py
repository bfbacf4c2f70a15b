"""The transformers runner's record of where the weights ran (``quality.devices``): one naming for both of its
sources, accelerate's ``hf_device_map`` (a GPU as a bare index) and the parameters' own devices (``cuda:0``).
On an H200 with transformers 5.17, ``device_map="auto"`` on one GPU left ``hf_device_map`` unset and the run
recorded ``cuda:0`` where a multi-GPU run would have recorded ``0`` (tests/evaluators/test_reference_gpu.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluators.transformers.runner import device_name, placement


def test_device_names_are_torchs() -> None:
    assert [device_name(d) for d in (0, "1", "cuda:0", torch.device("cpu"), "disk")] == \
        ["cuda:0", "cuda:1", "cuda:0", "cpu", "disk"]


def test_placement_names_devices_alike_from_either_source() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert placement(model) == ["cpu"]
    model.hf_device_map = {"0": 0, "1": 1, "2": "cpu", "3": 0}  # as accelerate's dispatch sets it
    assert placement(model) == ["cuda:0", "cuda:1", "cpu"]


def _vendor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def test_cpu_logits_do_not_depend_on_the_thread_count(tmp_path: Path, demo_model: Path) -> None:
    """The runner scores the same windows to the same bits at 1 and 2 threads, with MKL_ENABLE_INSTRUCTIONS=AVX2
    (on Intel that forces MKL's AVX2 code path, where threads matter; Intel's AVX-512 path gave equal bits either
    way when measured). It says which MKL mode it ran in. The control, on Intel: with the caller's plain
    ``MKL_CBWR=AUTO`` the same two runs differ (measured on Intel). On an AMD EPYC (2026-12-06) MKL ignored the
    variable and ran its path for non-Intel processors, which gave equal bits with and without STRICT
    (bench/results/mkl_thread_invariance_amd_2026-12-06.txt): off Intel this is a check of thread invariance with
    no control. MKL documents its strict mode for Intel CPUs: off Intel a difference ends the test as xfailed,
    with what differed, instead of failing CI on a documented limit."""
    from evaluators.base import RunnerCommand, run_runner
    from evaluators.windows import build_window_set
    from pipeline.specs import Engine

    ws = build_window_set(demo_model, (demo_model / "eval.txt").read_text(), window=256, stride=256,
                          max_windows=4)
    ws.save(tmp_path / "w.npz")

    def run(threads: int, env: dict[str, str]) -> tuple[dict, dict[str, np.ndarray]]:
        cmd = RunnerCommand(engine=Engine.TRANSFORMERS, python=sys.executable,
                            module="evaluators.transformers.runner", env={"MKL_ENABLE_INSTRUCTIONS": "AVX2", **env})
        out = run_runner(cmd, {"model": str(demo_model), "windows": str(tmp_path / "w.npz"), "top_k": 8,
                               "threads": threads, "dtype": "float32", "device": "cpu"},
                         tmp_path / f"out-{threads}-{len(env)}", timeout_s=300)
        assert out.arrays is not None
        with np.load(out.arrays) as z:
            return out.result, {k: z[k] for k in z.files}

    (r1, one), (r2, two) = run(1, {}), run(2, {})
    assert r1["quality"]["mkl_cbwr"] == r2["quality"]["mkl_cbwr"] == "AUTO,STRICT"
    assert one.keys() == two.keys() and "target_logprob" in one
    unequal = [k for k in one if not np.array_equal(one[k], two[k])]
    intel = (vendor := _vendor()) == "GenuineIntel"
    if unequal and not intel:
        # MKL documents its strict mode for Intel CPUs; on another vendor this is what was found, shown, not passed
        pytest.xfail(f"on a {vendor or 'unknown'} CPU, MKL_CBWR=AUTO,STRICT left {unequal} different at 1 and "
                     "2 threads: the runner's logits depend on the thread count there")
    assert not unequal, unequal
    (c1, plain1), (_, plain2) = run(1, {"MKL_CBWR": "AUTO"}), run(2, {"MKL_CBWR": "AUTO"})
    assert c1["quality"]["mkl_cbwr"] == "AUTO"  # the caller's setting is kept, and recorded
    differs = not np.array_equal(plain1["target_logprob"], plain2["target_logprob"])
    if intel:
        assert differs, "without STRICT, MKL's AVX2 path gave the same bits at 1 and 2 threads: the check shows nothing"
