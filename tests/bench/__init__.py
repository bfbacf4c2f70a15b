"""Tests of the bench scripts: their bookkeeping, and end-to-end runs on a local folder
(:func:`demo_copy_without_eval_text`). The scripts are not a package: :func:`load_script` loads one."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_script(name: str) -> ModuleType:
    """``bench/NAME.py`` as the module ``bench_NAME``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def demo_copy_without_eval_text(demo: Path, dest: Path) -> Path:
    """A copy of the demo checkpoint's files in ``dest``, less its eval.txt and calibration.txt: a local folder
    the bench scripts were not built for, whose evaluation text must come from Quantyard's built-in one."""
    dest.mkdir()
    for f in demo.iterdir():
        if f.is_file() and f.name not in ("eval.txt", "calibration.txt"):
            shutil.copy2(f, dest / f.name)
    return dest
