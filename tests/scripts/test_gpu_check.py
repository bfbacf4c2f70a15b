"""scripts/gpu-check.sh run-all on a machine without CUDA: every step runs and reports, and what it leaves under
$OUT is two files (its log and one archive of everything else), because the lent device returns at most 8 files
per call and dropped the first run's results beyond that (bench/results/gpu_check_h200_2026-12-04.txt)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_run_all_without_cuda_reports_each_step_and_leaves_one_archive(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "RUN_ALL_BUDGET_S": "400",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # python3: this interpreter
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "run-all"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # no CUDA: the EXL2 steps fail; never a success
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.log", "gpu-check.tgz"]
    log = (out / "gpu-check.log").read_text()
    assert "reference GPU tests" in log and "skipped" in log and "exl2 compile: FAILED" in log, log
    with tarfile.open(out / "gpu-check.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"probe.json", "reference-pytest.log", "exl2-compile.log", "gpu-check.log"} <= names, names
