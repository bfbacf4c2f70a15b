"""flows/console.py: a stage's typed failure is one line on the terminal and whole in Prefect's logs."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

FAILING_TASKS = """\
import sys
from pathlib import Path
from pipeline.cli import leave
from flows import embedded
server = embedded.start(Path(sys.argv[1]))
assert server is not None and server.decision() == "url"
from prefect import flow, task
from flows.console import quiet_typed_failures
from pipeline.errors import ConversionError
server.ready()
assert quiet_typed_failures() == 1

def deep_inside_the_converter() -> None:
    raise ConversionError("AWQ quantization exited with code 1", hint="see the log /x/awq.err")

def deep_inside_a_bug() -> None:
    raise RuntimeError("an unexpected bug")

@task(retries=0)
def typed() -> None:
    deep_inside_the_converter()

@task(retries=0)
def untyped() -> None:
    deep_inside_a_bug()

@flow
def stages() -> None:
    for t in (typed, untyped):
        try:
            t()
        except Exception:
            pass

stages()
leave(0)
"""


def test_a_typed_failure_prints_one_line_and_prefect_keeps_its_traceback(tmp_path: Path) -> None:
    """A variant whose build failed with a typed error printed Quantyard's whole call stack on the terminal
    (Prefect logs a failed task with its traceback) above the table that names the failure; now the terminal
    has Prefect's line for it, the run's logs in Prefect hold the traceback, and a bug keeps it everywhere."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING")
    res = subprocess.run([sys.executable, "-c", FAILING_TASKS, str(tmp_path / "logs")], env=env,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    err = res.stderr
    assert "ConversionError: AWQ quantization exited with code 1" in err, err[-3000:]  # Prefect's line for it
    assert "deep_inside_the_converter" not in err, err[-3000:]  # no traceback on the terminal
    assert "deep_inside_a_bug" in err and "RuntimeError: an unexpected bug" in err, err[-3000:]
    with sqlite3.connect(home / "prefect.db") as db:
        messages = "\n".join(m for (m,) in db.execute("SELECT message FROM log"))
    assert "deep_inside_the_converter" in messages, messages[-3000:]  # whole in Prefect's logs
