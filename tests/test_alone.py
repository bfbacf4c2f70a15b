"""The ``alone`` marker (tests/alone.py), in pytest-xdist runs of their own: two workers, one running three
ordinary tests, the other an ``alone`` test, each test recording when it ran. With the plugin the ``alone`` test
overlaps none of the others; without it (the control run) it overlaps one, so the check can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = '''
import json, os, time
from pathlib import Path

def record(name):
    t0 = time.monotonic()
    time.sleep(1.0)
    Path(os.environ["ALONE_LOG"], name).write_text(json.dumps([t0, time.monotonic()]))
'''


def _spans(tmp_path: Path, plugin: bool) -> tuple[dict[str, tuple[float, float]], str]:
    tmp_path.mkdir()
    (tmp_path / "record_span.py").write_text(RECORD)
    (tmp_path / "test_others.py").write_text(
        "import record_span\n" + "".join(f"def test_other_{i}():\n    record_span.record('other{i}')\n"
                                         for i in range(3)))
    (tmp_path / "test_solo.py").write_text(
        "import pytest, record_span\n@pytest.mark.alone\ndef test_solo():\n    record_span.record('solo')\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: the machine to itself\n")
    log = tmp_path / "log"
    log.mkdir()
    args = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
            "--basetemp", str(tmp_path / "base"), *(["-p", "tests.alone"] if plugin else [])]
    env = {**os.environ, "ALONE_LOG": str(log), "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return {p.name: tuple(json.loads(p.read_text())) for p in log.iterdir()}, done.stdout


def _overlapping(spans: dict[str, tuple[float, float]]) -> list[str]:
    s0, s1 = spans["solo"]
    return [name for name, (a, b) in spans.items() if name != "solo" and a < s1 and s0 < b]


def test_an_alone_test_overlaps_no_other_test_and_its_wait_is_reported(tmp_path: Path) -> None:
    spans, out = _spans(tmp_path / "with", plugin=True)
    assert len(spans) == 4 and _overlapping(spans) == [], spans
    assert "alone: test_solo.py::test_solo waited" in out, out


def test_without_the_plugin_the_same_tests_overlap(tmp_path: Path) -> None:
    spans, _ = _spans(tmp_path / "without", plugin=False)
    assert len(spans) == 4 and _overlapping(spans), spans
