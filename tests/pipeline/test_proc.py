"""A failed tool or engine subprocess leaves its evidence: its logs are kept under the logs root, the
path an error prints exists after the step's scratch folder is gone, and old run folders are pruned."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from evaluators.llamacpp.evaluator import LlamaCppEvaluator
from evaluators.windows import cut_windows
from pipeline import proc
from pipeline.errors import EngineError
from pipeline.plan import EvalSpec, SpeedSpec
from pipeline.proc import RUN_ID, failure_log_dir, prune_logs, run_logged
from tests.conftest import make_settings

FAIL = "import sys; print('progress', flush=True); print('the real cause', file=sys.stderr); sys.exit(3)"


def test_failed_child_logs_outlive_their_folder(tmp_path: Path) -> None:
    keep = failure_log_dir(tmp_path / "logs")
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
        res = run_logged([sys.executable, "-c", FAIL], log_dir=Path(scratch), name="worker", timeout_s=60, keep=keep)
    assert not Path(scratch).exists() and res.returncode == 3
    assert res.log == keep / "worker.err" and keep.parent.name == "logs" and keep.name == RUN_ID
    assert "the real cause" in res.log.read_text() and "progress" in (keep / "worker.out").read_text()
    again = run_logged([sys.executable, "-c", FAIL], log_dir=tmp_path, name="worker", timeout_s=60, keep=keep)
    assert again.log == keep / "worker-2.err"  # a second failure of the same step does not overwrite the first


def test_successful_child_keeps_nothing(tmp_path: Path) -> None:
    keep = failure_log_dir(tmp_path / "logs")
    res = run_logged([sys.executable, "-c", "print('fine')"], log_dir=tmp_path, name="ok", timeout_s=60, keep=keep)
    assert res.ok and res.log == tmp_path / "ok.err" and not keep.exists()


def test_old_log_folders_are_pruned_by_count_and_age(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    now = time.time()
    for i in range(proc.KEEP_RUNS + 10):  # newest first: i = 0 is the newest
        d = root / f"run-{i:03d}"
        d.mkdir(parents=True)
        os.utime(d, (now - i * 60, now - i * 60))
    ancient = root / "ancient"
    ancient.mkdir()
    os.utime(ancient, (now - 30 * 86400, now - 30 * 86400))
    mine = root / RUN_ID
    mine.mkdir()
    os.utime(mine, (now - 40 * 86400, now - 40 * 86400))  # this process's own folder is never removed
    removed = prune_logs(root)
    left = sorted(p.name for p in root.iterdir())
    assert RUN_ID in left and "ancient" not in left and ancient in removed
    assert sorted(n for n in left if n.startswith("run-")) == [f"run-{i:03d}" for i in range(proc.KEEP_RUNS - 1)]


def test_engine_error_points_at_a_log_that_exists(tmp_path: Path, registry_path: Path, cache_dir: Path) -> None:
    """The runner runs in a scratch folder that is removed when the step ends (as the flow's is); the
    hint of the error still names an existing copy of the runner's stderr."""
    cfg = make_settings(registry_path, tmp_path / "work", cache_dir, logs_dir=tmp_path / "logs")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + np.arange(64, dtype=np.uint32).tobytes())  # magic, then nonsense
    windows = tmp_path / "windows.npz"
    cut_windows(list(range(3, 67)), window=32, stride=32, bos_id=None).save(windows)
    spec = EvalSpec(speed=SpeedSpec(enabled=False))
    with tempfile.TemporaryDirectory(dir=tmp_path) as scratch, pytest.raises(EngineError) as err:
        LlamaCppEvaluator().evaluate(broken, windows=windows, window_set_id="w", reference=windows, spec=spec,
                                     out_dir=Path(scratch) / "eval", settings=cfg)
    assert not Path(scratch).exists()
    hint = err.value.hint or ""
    assert hint.startswith("full log: ")
    log = Path(hint.removeprefix("full log: "))
    assert log.is_file() and log.is_relative_to(tmp_path / "logs" / RUN_ID)
    assert log.read_text().strip() and err.value.stderr_tail.strip() in log.read_text()
