"""Supervision of server processes: start one under its keeper, stop it, and record it so that a later run can
sweep what a killed run left behind.

A server runs as ``keeper → server → (its children)`` in a process group of its own, led by the keeper
(``evaluators/serving/keeper.py``: it SIGKILLs the group when Quantyard dies, SIGKILL included). Each running
server has a record ``WORK/servers/<owner pid>-<keeper pid>.json`` (owner, keeper and server pids with their
start times, engine, URL, log); :func:`sweep_stale_servers` kills the groups of records whose owner is gone
and removes the records, as ``flows.steps.sweep_stale`` does for scratch folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil  # type: ignore[import-untyped]

from evaluators.serving.keeper import group_members
from pipeline.fs import write_atomic

KEEPER = "evaluators.serving.keeper"
SERVERS_DIR = "servers"
#: Seconds to wait for the keeper to have started the server.
CHILD_WAIT_S = 10.0


@dataclass(frozen=True)
class ServerRecord:
    """One running server as recorded on disk (pids with their start times, seconds since the epoch)."""

    owner: int
    owner_started: float
    keeper: int  # also the process group
    keeper_started: float
    server: int
    server_started: float
    engine: str
    base_url: str
    log: str


def _started(pid: int) -> float:
    return float(psutil.Process(pid).create_time())


def _alive(pid: int, started: float) -> bool:
    """Whether ``pid`` runs and is the process that started at ``started`` (not a reused pid)."""
    try:
        return abs(_started(pid) - started) < 1.0
    except psutil.NoSuchProcess:
        return False


def launch(python: str, command: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` under the keeper (``python -m evaluators.serving.keeper``) in a new session, stdout
    and stderr appended to ``log_path``; returns the keeper's process (its pid is the group's)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen([python, "-m", KEEPER, str(os.getpid()), "--", *command], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, env=dict(env), start_new_session=True)


def server_pid(keeper: subprocess.Popen[bytes], timeout_s: float = CHILD_WAIT_S) -> int | None:
    """The pid of the server the keeper started (None when the keeper exited first or took too long)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and keeper.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            children = psutil.Process(keeper.pid).children()
            if children:
                return int(children[0].pid)
        time.sleep(0.02)
    return None


def record(root: Path, keeper: subprocess.Popen[bytes], server: int, engine: str, base_url: str,
           log_path: Path) -> Path:
    """Write the record of a running server under ``root/servers``; returns its path."""
    rec = ServerRecord(owner=os.getpid(), owner_started=_started(os.getpid()), keeper=keeper.pid,
                       keeper_started=_started(keeper.pid), server=server, server_started=_started(server),
                       engine=engine, base_url=base_url, log=str(log_path))
    path = root / SERVERS_DIR / f"{rec.owner}-{rec.keeper}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(asdict(rec), indent=1).encode())
    return path


def kill_group(pgid: int, since: float) -> list[int]:
    """SIGKILL the members of process group ``pgid`` that started at or after ``since`` (the keeper's start:
    older processes are not ours); returns their pids."""
    killed = []
    for pid in group_members(pgid):
        try:
            if _started(pid) + 1.0 >= since:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return killed


def stop(keeper: subprocess.Popen[bytes], grace_s: float, strays: Sequence[int] = ()) -> int:
    """Stop a server: SIGTERM to its process group, SIGKILL after ``grace_s`` seconds, then SIGKILL whatever
    is left in the group and any of ``strays`` (descendants seen earlier that may have left the group);
    returns the keeper's exit status (the server's: 128 + signal when a signal ended it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(keeper.pid, signal.SIGTERM)
    try:
        keeper.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(keeper.pid, signal.SIGKILL)
        keeper.wait()
    for pid in [*group_members(keeper.pid), *strays]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return int(keeper.returncode)


def sweep_stale_servers(root: Path) -> list[ServerRecord]:
    """Kill the servers that killed runs left behind (their owner is gone) and remove their records under
    ``root/servers``; returns the records swept. Records of live owners are kept."""
    swept = []
    folder = root / SERVERS_DIR
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            rec = ServerRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            path.unlink(missing_ok=True)  # unreadable: a record torn by a crash; nothing to kill by it
            continue
        if _alive(rec.owner, rec.owner_started):
            continue
        kill_group(rec.keeper, rec.keeper_started)
        if _alive(rec.server, rec.server_started):  # it may have left the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.server, signal.SIGKILL)
        path.unlink(missing_ok=True)
        swept.append(rec)
    return swept
