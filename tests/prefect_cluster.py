"""A real Prefect deployment on loopback for tests and benchmarks: ``prefect server start`` with its own
PREFECT_HOME, process work pools, ``prefect worker start`` processes, and the Quantyard CLI run against
them, each a subprocess with its own environment (so nothing collides with the session's
``prefect_test_harness``). Everything started here is stopped by PID, descendants included.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first found, then theirs), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid`` and every process below it, each by its PID."""
    for p in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


class PrefectCluster:
    """One Prefect server and its workers, all children of this process, under ``root``."""

    def __init__(self, root: Path, extra_env: dict[str, str] | None = None) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        home = root / "prefect-home"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update({
            "PREFECT_HOME": str(home), "PREFECT_API_URL": self.url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1", "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO", "PREFECT_API_DATABASE_CONNECTION_URL":
                f"sqlite+aiosqlite:///{home}/prefect.db", "PYTHONPATH": str(REPO),
        })
        env.update(extra_env or {})
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- processes -------------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("ab")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_server(self, timeout: float = 180) -> None:
        proc = self._spawn("server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(self.port)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited {proc.returncode}:\n{self.log('server')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"prefect server not healthy after {timeout} s:\n{self.log('server')[-3000:]}")

    def start_worker(self, pool: str) -> subprocess.Popen[bytes]:
        return self._spawn(f"worker-{pool}", [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                                              "--type", "process"])

    def wait_worker(self, pool: str, timeout: float = 120) -> None:
        """Until the pool has an online worker (its first heartbeat reached the server)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = self.api("POST", f"/work_pools/{pool}/workers/filter", {})
            if any(w.get("status") == "ONLINE" for w in workers):
                return
            proc = self.procs[f"worker-{pool}"]
            if proc.poll() is not None:
                raise RuntimeError(f"worker {pool} exited:\n{self.log(f'worker-{pool}')[-3000:]}")
            time.sleep(0.5)
        raise RuntimeError(f"no worker came online in pool {pool}")

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)

    def stop_all(self) -> None:
        for name in [n for n in self.procs if n != "server"] + ["server"]:
            self.stop(name)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- the CLI and the API ---------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, cwd=self.root)

    def cli_json(self, *args: str, timeout: float = 900) -> Any:
        out = self.cli(*args, "--json", timeout=timeout)
        assert out.returncode == 0, f"quantyard {' '.join(args)} exited {out.returncode}:\n" \
                                    f"{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
        return json.loads(out.stdout[out.stdout.index(next(c for c in out.stdout if c in "[{")):])

    def cli_popen(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        return self._spawn(name, [sys.executable, "-m", "pipeline.cli", *args])

    def api(self, method: str, path: str, body: Any = None) -> Any:
        resp = httpx.request(method, f"{self.url}{path}", json=body, timeout=30)
        resp.raise_for_status()
        return resp.json() if resp.content else None

    def flow_runs(self) -> list[dict[str, Any]]:
        return list(self.api("POST", "/flow_runs/filter", {"limit": 200, "sort": "EXPECTED_START_TIME_ASC"}))
