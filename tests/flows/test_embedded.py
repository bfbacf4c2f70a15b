"""flows/embedded.py: Prefect's embedded server launched before Prefect is imported, its child deciding from
Prefect's own settings, the server stopped at exit and killed with a killed parent. Each case runs in a fresh
interpreter (the module refuses to start where Prefect is imported, as it is in this test process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest

from flows import embedded
from pipeline.errors import OrchestratorError
from pipeline.proc import REPO_ROOT
from tests.conftest import pids_with, procs_with_env

#: Starts the server in a fresh interpreter, reports what it decided (and, once healthy, its URL and pid).
SCRIPT = """
import json, os, sys, time
from pathlib import Path
from flows import embedded
from pipeline.errors import OrchestratorError
server = embedded.start(Path(sys.argv[1]))
out = {"started": server is not None}
if server is not None:
    out["decision"] = server.decision()
    out["api_url_env"] = os.environ.get("PREFECT_API_URL")
    try:
        server.ready()
        out["pid"] = server.proc.pid
        import prefect.settings
        out["prefect_api_url"] = prefect.settings.PREFECT_API_URL.value()
    except OrchestratorError as exc:
        out["error"] = exc.to_dict()
print(json.dumps(out), flush=True)
if sys.argv[2:] == ["hold"]:
    time.sleep(600)
"""


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(REPO_ROOT), **extra)
    return env


def _run(tmp_path: Path, **extra: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "logs")], env=_env(tmp_path / "home", **extra),
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _servers(home: Path) -> list[int]:
    """Live launcher processes (``python -m flows.embedded``) whose environment names this PREFECT_HOME."""
    return sorted(set(procs_with_env("PREFECT_HOME", str(home))) & set(pids_with(b"flows.embedded")))


def test_a_server_named_by_the_active_profile_is_used_and_nothing_is_started(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "profiles.toml").write_text('active = "remote"\n\n[profiles.remote]\n'
                                        'PREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    out = _run(tmp_path)
    assert out["decision"] == "configured" and out["api_url_env"] is None, out
    assert out["prefect_api_url"] == "http://127.0.0.1:9/api" and "pid" in out
    assert not (home / "prefect.db").exists()


def test_with_the_temporary_server_turned_off_it_starts_nothing(tmp_path: Path) -> None:
    out = _run(tmp_path, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="false")
    assert out["decision"] == "off" and out["api_url_env"] is None, out
    assert not (tmp_path / "home" / "prefect.db").exists()


def test_a_server_that_cannot_start_is_a_typed_error_naming_its_log(tmp_path: Path) -> None:
    bad = f"sqlite+aiosqlite:///{tmp_path / 'no-such-folder' / 'prefect.db'}"
    out = _run(tmp_path, PREFECT_API_DATABASE_CONNECTION_URL=bad)
    assert out["decision"] == "url", out
    error = out["error"]
    assert isinstance(error, dict) and error["type"] == "OrchestratorError", out
    assert "exited with code" in str(error["message"]) and str(tmp_path / "logs") in str(error["message"])
    assert _servers(tmp_path / "home") == []


def test_without_a_configured_server_it_serves_prefect_and_dies_with_a_killed_parent(tmp_path: Path) -> None:
    """The child serves Prefect's server app and Prefect, imported after the decision, uses it. SIGKILL then
    leaves no exit handler to run: the server goes because the kernel kills it (PR_SET_PDEATHSIG). (A normal
    exit stops it too: tests/flows/test_reuse.py, the CLI run without a server.)"""
    home = tmp_path / "home"
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "logs"), "hold"], env=_env(home),
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert parent.stdout is not None
        out = json.loads(parent.stdout.readline())
        assert out["started"] and out["decision"] == "url" and "error" not in out, out
        url = str(out["api_url_env"])
        assert url.startswith("http://127.0.0.1:") and url.endswith("/api")
        assert out["prefect_api_url"] == url
        assert (home / "prefect.db").is_file()  # Prefect's server app made its database
        pid = int(out["pid"])
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            assert resp.status == 200
        assert _servers(home) == [pid]
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the embedded server outlived its killed parent"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in _servers(home):
            os.kill(pid, signal.SIGKILL)


def test_it_starts_nothing_where_prefect_is_imported_or_a_server_is_set(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import prefect  # noqa: F401 - imported, as in this test process: its settings can no longer be redirected

    launchers = set(pids_with(b"flows.embedded"))
    assert embedded.start(tmp_path) is None
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.delitem(sys.modules, "prefect")
    assert embedded.start(tmp_path) is None
    assert not list(tmp_path.iterdir())  # no launcher log: nothing was launched
    assert set(pids_with(b"flows.embedded")) <= launchers


def test_an_unreadable_decision_is_a_typed_error(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "print('hello')"], stdout=subprocess.PIPE)
    server = embedded.Embedded(proc=proc, log=tmp_path / "none.log")
    with pytest.raises(OrchestratorError, match="its launcher said 'hello'"):
        server.decision(timeout_s=30)
    proc.wait()


def test_the_warm_up_asks_the_api_once_it_serves_and_a_dead_server_changes_nothing() -> None:
    """The child's warm-up (embedded._warm): one GET of the API's version, waiting in the socket's queue until the
    server accepts; where nothing listens it returns quietly."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # listening, not serving yet: the warm-up's request waits in the queue
    port = sock.getsockname()[1]
    warm = threading.Thread(target=embedded._warm, args=(f"http://127.0.0.1:{port}/api",))
    warm.start()
    time.sleep(0.3)
    assert warm.is_alive() and not seen
    server = HTTPServer(("127.0.0.1", port), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    threading.Thread(target=server.handle_request, daemon=True).start()
    warm.join(10)
    assert not warm.is_alive() and seen == ["/api/admin/version"]
    server.server_close()
    t0 = time.monotonic()
    embedded._warm(f"http://127.0.0.1:{port}/api")  # nothing listens now: connection refused, nothing raised
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(("decided", "beats"), [("url", None), ("configured", 180), (None, 180)])
def test_flow_runs_on_the_embedded_server_send_no_heartbeats(tmp_path: Path, decided: str | None,
                                                             beats: int | None) -> None:
    """Heartbeats are off inside the block only where the server is this process's own (it dies with the process;
    the flow engine's join of their thread cost up to 1 s per flow); a configured server keeps them."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 180}):
        proc = subprocess.Popen(["true"])
        proc.wait()
        server = None if decided is None else embedded.Embedded(proc=proc, log=tmp_path / "log", decided=decided)
        with embedded.without_heartbeats(server):
            assert get_current_settings().flows.heartbeat_frequency == beats
        assert get_current_settings().flows.heartbeat_frequency == 180


def test_ctrl_c_stops_the_command_at_once_and_its_server_after_it(demo_model: Path, cache_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals the whole foreground process group. The server used to be in it: it died
    first, and the command, interrupted, spent 99 s retrying to tell it the flow had crashed, then ended on an
    internal error (httpx ConnectError, exit 4). In a session of its own it outlives the interrupt by the time the
    command takes to record the crash and stop it: exit 130 within seconds, nothing left running, the registry
    readable and whole. (SIGKILL of the command still takes it down: PR_SET_PDEATHSIG, tested above.)"""
    home, work, registry = tmp_path / "prefect", tmp_path / "work", tmp_path / "registry"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(home), QUANTYARD_WORK_DIR=str(work), QUANTYARD_CACHE_DIR=str(cache_dir))
    args = ["convert", str(demo_model), "--gguf", "Q8_0", "--no-speed", "--registry", str(registry)]
    # a session of its own, as a terminal's foreground job: its process group is what Ctrl-C signals. SIGINT at
    # its default, as in a terminal: a test run in the background (nohup ... &) inherits it ignored, and Python
    # then keeps it ignored (the command ran to the end in such a CI run)
    default_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.argv[1], sys.argv[1:])")
    log = tmp_path / "output.txt"
    with log.open("w") as output:  # a file, not a pipe: nothing blocks on a full pipe
        proc = subprocess.Popen([sys.executable, "-c", default_sigint, sys.executable, "-m", "pipeline.cli", *args],
                                env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not set(procs_with_env("QUANTYARD_WORK_DIR", str(work))) & set(pids_with(b"evaluators.")):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no evaluation started within 300 s"
            time.sleep(0.1)
        interrupted = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        took = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = log.read_text()
    assert proc.returncode == 130, err[-3000:]
    assert took < 20, f"the command took {took:.0f} s to stop after Ctrl-C"
    assert "ConnectError" not in err and "internal error" not in err, err[-3000:]
    assert "interrupt" in err  # Prefect says so: 'Execution was aborted by an interrupt signal'
    deadline = time.monotonic() + 10
    while procs_with_env("PREFECT_HOME", str(home)) or procs_with_env("QUANTYARD_WORK_DIR", str(work)):
        assert time.monotonic() < deadline, "a server or runner outlived the interrupted command"
        time.sleep(0.1)
    verify = [sys.executable, "-m", "pipeline.cli", "registry", "verify", "--registry", str(registry)]
    check = subprocess.run(verify, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
