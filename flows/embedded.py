"""Prefect's embedded server for the runs of this process, started without importing Prefect's server here.

With no Prefect API URL configured, a Prefect flow starts a temporary server of its own: it imports
``prefect.server.api.server`` in the calling process (about 5 s of one core, holding the GIL) only to launch
``uvicorn`` on that module's app in a child, which imports it again. Measured on 2 cores (real checkpoint),
that import ran in a thread beside the source's resolution and held it back: for the first 6 s one core
worked and the other idled, because the child was not launched yet.

:func:`start` launches the child at once, before Prefect is imported here (``python -m flows.embedded``). The
child reads Prefect's settings the way Prefect does (environment, profile, ``prefect.toml``) and says on its
first line of output what it decided:

- ``configured``: a Prefect API URL is set; the child exits and flows use that server;
- ``off``: Prefect's temporary server is turned off (``server.ephemeral.enabled`` false); the child exits and a
  flow fails in Prefect's words;
- ``url <URL>``: it serves Prefect's server app on a loopback port it holds, as Prefect's own temporary server
  does (no UI, no background services); and asks its own API once as soon as it serves, so that what the server
  initialises on its first request (about 0.4 s here) is done while the caller resolves its source.

:meth:`Embedded.decision` reads that line and, for a URL, sets ``PREFECT_API_URL`` so Prefect, imported after it,
uses this server. :meth:`Embedded.ready` waits for its health endpoint before a flow runs. One server serves
every run of the process (a recipe runs several); it is stopped when the process exits, and dies with the
process when that is killed (``PR_SET_PDEATHSIG``), where Prefect's own temporary server outlives a killed
client. It runs in a session of its own, so that Ctrl-C, which signals the terminal's whole foreground process
group, interrupts the command and not its server: the command then records the crash on the server and stops it
(exit 130 within a second). In the group, the server died first and the interrupted command retried for 99 s to
reach it, then ended on an internal ConnectError. Where Prefect is already imported in this process (a test, a
library user) its settings are fixed, so :func:`start` starts nothing and a flow starts Prefect's own server, as
before.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import OrchestratorError
from pipeline.proc import child_env, die_with_parent

#: How long the child may take to decide, and the server to answer its health check (a cold start included).
READY_TIMEOUT_S = 120.0
CONFIGURED, OFF = "configured", "off"


@dataclass
class Embedded:
    """The child: its process, its log, and (once read) its decision."""

    proc: subprocess.Popen[bytes]
    log: Path
    url: str | None = None
    decided: str | None = None
    healthy: bool = False

    def decision(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The child's decision (``configured``, ``off`` or ``url``), read once; for ``url``, ``PREFECT_API_URL``
        now names the server. Call it before Prefect is imported.

        Raises:
            OrchestratorError: the child exited or said nothing within ``timeout_s``.
        """
        if self.decided is not None:
            return self.decided
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        self.proc.stdout.close()
        word, _, url = line.partition(" ")
        if word not in (CONFIGURED, OFF, "url") or (word == "url" and not url):
            self._fail(f"Prefect's embedded server did not start: its launcher said {line!r}")
        self.decided = word
        if word == "url":
            self.url = url
            os.environ["PREFECT_API_URL"] = url
        return word

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until the server answers its health check (at once once it has). Nothing to wait for where the
        child decided not to serve.

        Raises:
            OrchestratorError: it exited, or did not answer within ``timeout_s``.
        """
        if self.decision(timeout_s) != "url" or self.healthy:
            return
        deadline = time.monotonic() + timeout_s
        while not self.healthy:
            if self.proc.poll() is not None:
                self._fail(f"Prefect's embedded server exited with code {self.proc.returncode} before it answered")
            if time.monotonic() > deadline:
                self._fail(f"Prefect's embedded server did not answer {self.url}/health within {timeout_s:.0f} s")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    self.healthy = resp.status == 200
            except (OSError, urllib.error.URLError):
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL after 5 s, as Prefect stops its own); its log is kept where it
        holds something (the server logs errors only). The process's server is then forgotten, if it is this."""
        global _SERVER
        if _SERVER is self:
            _SERVER = None
        if self.url is not None and os.environ.get("PREFECT_API_URL") == self.url:
            del os.environ["PREFECT_API_URL"]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log.is_file() and self.log.stat().st_size == 0:
            self.log.unlink()  # it logged nothing (errors only): nothing to keep

    def _fail(self, message: str) -> None:
        self.stop()
        tail = self.log.read_text(errors="replace")[-2000:] if self.log.is_file() else ""
        raise OrchestratorError(f"{message}; its log {self.log} ends: {tail.strip() or '(empty)'}",
                                hint="read that log; or set PREFECT_API_URL to a running Prefect server")


_SERVER: Embedded | None = None


def start(log_dir: Path) -> Embedded | None:
    """Launch the child (once per process); it decides and starts while the caller goes on. None, launching
    nothing, when ``PREFECT_API_URL`` is set or Prefect is already imported here."""
    global _SERVER
    if _SERVER is not None:
        return _SERVER
    if os.environ.get("PREFECT_API_URL") or "prefect" in sys.modules:
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"prefect-embedded-{os.getpid()}.log"
    # an ephemeral server (no UI, no background services), the only app of its process: Prefect's own settings
    env = child_env({"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"})
    with log.open("ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "flows.embedded"], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                preexec_fn=die_with_parent)
    _SERVER = Embedded(proc=proc, log=log)
    atexit.register(stop)
    return _SERVER


def without_heartbeats(server: Embedded | None) -> AbstractContextManager[Any]:
    """Flow runs in this block send no heartbeats where ``server`` is this process's own. Prefect's flow-run
    heartbeats (every 180 s by default) let a server mark a run whose process died as crashed; this server dies
    with the process, so they tell nobody anything, and the flow engine joins their thread when a flow ends, which
    sleeps in 1 s steps: up to 1 s per flow (measured here: a flow's end 0.16-0.17 s after its last stage without
    them, 0.36 and 1.14 s with). With a configured server they stay on. Call it after Prefect is imported
    (:meth:`Embedded.decision` first)."""
    if server is None or server.decided != "url":
        return contextlib.nullcontext()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def stop() -> None:
    """Stop this process's server, if it started one (:meth:`Embedded.stop`); run at exit."""
    if _SERVER is not None:
        _SERVER.stop()


def _serve() -> None:
    """The child: decide from Prefect's settings, say so on stdout, and serve when it is ours to."""
    import socket

    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        print(CONFIGURED, flush=True)
        return
    if not settings.server.ephemeral.enabled:
        print(OFF, flush=True)
        return
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # held from here on: no other process can take the port before uvicorn serves
    sock.listen(128)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/api"
    print(f"url {url}", flush=True)
    os.dup2(2, 1)  # nothing reads stdout any more: anything printed goes to the log
    config = uvicorn.Config("prefect.server.api.server:create_app", factory=True, log_level="error", lifespan="on")
    threading.Thread(target=_warm, args=(url,), name="quantyard-warm", daemon=True).start()
    uvicorn.Server(config).run(sockets=[sock])


def _warm(url: str) -> None:
    """One API request as soon as the server serves: its first one initialises what it initialises on demand
    (about 0.4 s of the child's CPU here, where later requests take milliseconds), which so happens while the
    client still resolves its source, not on the flow's first call. It waits in the socket's queue until the
    server accepts; a failure changes nothing (the flow's first call then pays it, as before)."""
    with contextlib.suppress(OSError):
        urllib.request.urlopen(f"{url}/admin/version", timeout=READY_TIMEOUT_S).close()


if __name__ == "__main__":
    _serve()


__all__ = ["CONFIGURED", "OFF", "READY_TIMEOUT_S", "Embedded", "start", "stop", "without_heartbeats"]
