#!/usr/bin/env python3
"""Remove what earlier pytest sessions left in pytest's temporary root, before ``make setup`` installs anything.

pytest keeps its sessions' folders as ``<temproot>/pytest-of-<user>/pytest-<N>`` (``temproot``: the
``PYTEST_DEBUG_TEMPROOT`` variable, else the system's temporary folder) and, by its defaults, every test's folder
of the last three sessions: on a machine that ran the suite before its retention was set in pyproject.toml, those
can fill the disk before setup even starts (a CI run ran out of disk so). This removes every finished session's
folder but the newest ``--keep`` (default 1, for a look at the last failure); a session whose lock file names a
live process (one running now) is never touched.

Usage: prune_pytest_tmp.py [--keep N]. Only the standard library: it runs before the venv exists.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path


def temp_root() -> Path:
    """pytest's ``pytest-of-<user>`` folder (as _pytest.tmpdir computes it)."""
    base = Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir())
    try:
        user = getpass.getuser()
    except (ImportError, KeyError, OSError):
        user = "unknown"
    return base / ("pytest-of-" + re.sub(r"[\W]", "_", user))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(session: Path) -> bool:
    """Whether ``session``'s lock (``.lock``, holding the pid of the pytest that made it) names a live process."""
    try:
        text = (session / ".lock").read_text().strip()
    except OSError:
        return False
    return text.isdigit() and _alive(int(text))


def prune(root: Path, keep: int = 1) -> list[tuple[Path, int]]:
    """Remove the finished sessions under ``root`` but the newest ``keep``; returns each removed folder and its
    size in bytes."""
    if not root.is_dir():
        return []
    sessions = sorted((p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"pytest-\d+", p.name)),
                      key=lambda p: int(p.name.split("-")[1]), reverse=True)
    finished = [p for p in sessions if not running(p)]
    removed = []
    for path in finished[keep:]:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(path, ignore_errors=True)
        removed.append((path, size))
    return removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=int, default=1)
    args = parser.parse_args()
    root = temp_root()
    removed = prune(root, args.keep)
    total = sum(n for _, n in removed)
    print(f"[prune-pytest-tmp] {root}: removed {len(removed)} finished session(s), {total / 2**30:.2f} GiB",
          flush=True)


if __name__ == "__main__":
    main()
