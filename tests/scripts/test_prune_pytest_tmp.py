"""`make setup` first removes what earlier pytest sessions left (scripts/prune_pytest_tmp.py): every finished
session's folder but the newest, never one whose pytest is still running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prune_pytest_tmp.py"


def _session(root: Path, n: int, lock_pid: int | None, size: int = 100) -> Path:
    path = root / f"pytest-{n}"
    (path / "test_x0").mkdir(parents=True)
    (path / "test_x0" / "f.bin").write_bytes(b"x" * size)
    if lock_pid is not None:
        (path / ".lock").write_text(str(lock_pid))
    return path


def test_finished_sessions_go_but_the_newest_and_running_ones(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a pid that has just exited
    user = subprocess.run([sys.executable, "-c", "import getpass; print(getpass.getuser())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    root = tmp_path / f"pytest-of-{user}"
    old = _session(root, 3, None, 1000)
    crashed = _session(root, 4, int(dead), 2000)
    live = _session(root, 5, os.getpid())  # this process: a session still running
    newest = _session(root, 6, None)
    other = root / "not-a-session"
    other.mkdir()
    out = subprocess.run([sys.executable, str(SCRIPT)], env={**os.environ, "PYTEST_DEBUG_TEMPROOT": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout
    assert f"{root}: removed 2 finished session(s)" in out, out
    assert not old.exists() and not crashed.exists()
    assert live.is_dir() and newest.is_dir() and other.is_dir()
    subprocess.run([sys.executable, str(SCRIPT), "--keep", "0"], check=True, capture_output=True,
                   env={**os.environ, "PYTEST_DEBUG_TEMPROOT": str(tmp_path)})
    assert not newest.exists() and live.is_dir()
    empty = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTEST_DEBUG_TEMPROOT": str(tmp_path / "nothing")}).stdout
    assert "removed 0 finished session(s)" in empty
