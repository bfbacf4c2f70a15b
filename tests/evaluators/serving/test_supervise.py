"""Supervision without an engine: a stand-in server (a Python process with a child of its own) under the keeper.
A killed owner takes the whole group down, a clean stop escalates to SIGKILL when the server ignores SIGTERM,
and a later run sweeps what a killed run's record names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from evaluators.serving import supervise
from evaluators.serving.memory import tree_pids
from pipeline.proc import REPO_ROOT, child_env
from tests.evaluators.serving.helpers import alive, wait_gone

#: A stand-in server: it starts a child (as vLLM starts its engine core) and sleeps.
SERVER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
         "time.sleep(600)"
#: A stand-in server that ignores SIGTERM.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"

OWNER = """
import json, os, sys, time
from pathlib import Path
from evaluators.serving import supervise
from evaluators.serving.memory import tree_pids
keeper = supervise.launch(sys.executable, [sys.executable, "-c", sys.argv[1]], dict(os.environ), Path(sys.argv[2]))
server = supervise.server_pid(keeper)
while len(tree_pids(server)) < 2:
    time.sleep(0.05)
print(json.dumps({"keeper": keeper.pid, "tree": tree_pids(server)}), flush=True)
time.sleep(600)
"""


def _launch(tmp_path: Path, code: str) -> tuple[subprocess.Popen[bytes], int]:
    keeper = supervise.launch(sys.executable, [sys.executable, "-c", code], child_env(), tmp_path / "server.log")
    server = supervise.server_pid(keeper)
    assert server is not None
    return keeper, server


def test_a_killed_owner_takes_the_server_and_its_children_down(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, SERVER, str(tmp_path / "server.log")],
                             stdout=subprocess.PIPE, cwd=REPO_ROOT, env=child_env())
    assert owner.stdout is not None
    info = json.loads(owner.stdout.readline())
    pids = [info["keeper"], *info["tree"]]
    assert len(pids) == 3 and all(alive(p) for p in pids)
    t0 = time.monotonic()
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    assert wait_gone(pids, 5.0) == []
    assert time.monotonic() - t0 < 5.0


def test_stop_terminates_then_kills(tmp_path: Path) -> None:
    keeper, server = _launch(tmp_path, SERVER)
    while len(tree_pids(server)) < 2:
        time.sleep(0.05)
    tree = tree_pids(server)
    assert supervise.stop(keeper, grace_s=10.0) == 128 + signal.SIGTERM  # the server died from SIGTERM
    assert wait_gone([keeper.pid, *tree], 2.0) == []

    keeper, server = _launch(tmp_path, STUBBORN)
    time.sleep(0.5)  # let it install its SIG_IGN
    t0 = time.monotonic()
    supervise.stop(keeper, grace_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert wait_gone([keeper.pid, server], 2.0) == []


def test_sweep_kills_servers_whose_owner_is_gone(tmp_path: Path) -> None:
    work = tmp_path / "work"
    stale_keeper, stale_server = _launch(tmp_path, SERVER)
    live_keeper, live_server = _launch(tmp_path, SERVER)
    try:
        while len(tree_pids(stale_server)) < 2:
            time.sleep(0.05)
        stale_tree = tree_pids(stale_server)
        stale = supervise.record(work, stale_keeper, stale_server, "test", "http://127.0.0.1:1", tmp_path / "a.log")
        live = supervise.record(work, live_keeper, live_server, "test", "http://127.0.0.1:2", tmp_path / "b.log")
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        rec = json.loads(stale.read_text())
        stale.write_text(json.dumps({**rec, "owner": int(gone.stdout)}))  # as if written by a run now dead

        swept = supervise.sweep_stale_servers(work)

        assert [s.keeper for s in swept] == [stale_keeper.pid]
        stale_keeper.wait(5)
        assert wait_gone([stale_keeper.pid, *stale_tree], 5.0) == []
        assert not stale.exists() and live.exists() and alive(live_server)
    finally:
        supervise.stop(live_keeper, grace_s=5.0)
        supervise.stop(stale_keeper, grace_s=1.0)


def test_the_server_outlives_the_thread_that_started_it(tmp_path: Path) -> None:
    """The death signal follows the thread that started the keeper (Prefect runs tasks in threads): when that
    thread ends while its process lives, the keeper must keep the server."""
    box: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    worker = threading.Thread(target=lambda: box.update(started=_launch(tmp_path, SERVER)))
    worker.start()
    worker.join()
    keeper, server = box["started"]
    try:
        time.sleep(1.5)  # the death signal is immediate; the keeper's own poll runs every 0.5 s
        assert keeper.poll() is None and alive(server)
    finally:
        supervise.stop(keeper, grace_s=5.0)
