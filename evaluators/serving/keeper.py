"""The keeper: the one process between Quantyard and a server, so that no server outlives the run that started it.

Run as ``python -m evaluators.serving.keeper OWNER_PID -- COMMAND [ARGS...]`` (standard library only, any
interpreter). Quantyard starts it in a new session, so the keeper leads a process group of its own; it starts
``COMMAND`` (the server) in that group, and everything the server starts (vLLM's engine core and workers)
lands there too unless it leaves on purpose.

* **Quantyard is killed** (SIGKILL included): the kernel sends the keeper ``SIGUSR1`` (``PR_SET_PDEATHSIG``,
  set by the keeper itself at start, then checked against a race with ``getppid``), and the keeper SIGKILLs its
  whole process group: the server and all its children. A poll of ``getppid`` every :data:`POLL_S` seconds
  backs the signal up. The death signal follows the *thread* that started the keeper; when that thread ends
  while Quantyard lives, the keeper is re-parented inside Quantyard and ``getppid`` still names it, so a
  spurious signal is ignored.
* **The keeper is killed**: the server has ``PR_SET_PDEATHSIG=SIGKILL`` towards the keeper and dies with it.
* **Quantyard stops the server** (``SIGTERM`` to the group, then ``SIGKILL`` after a grace period): the server
  shuts down by itself; the keeper waits for it and exits with its status.
* **The server exits on its own** (a crash): the keeper kills what it left in the group and exits with the
  server's status (128 + signal for a signal, like a shell).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

#: Seconds between checks that the owner is still our parent.
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _set_death_signal(sig: int) -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _server_dies_with_keeper() -> None:
    """In the server, before exec (the keeper is single-threaded, so ``preexec_fn`` is safe here)."""
    _set_death_signal(signal.SIGKILL)


def _kill_group() -> None:
    """SIGKILL every process of our group, the keeper included."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """The pids whose process group is ``pgid`` (from /proc; empty where there is none)."""
    out = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def _kill_leftovers() -> None:
    """SIGKILL what the server left in our group (not the keeper itself)."""
    me = os.getpid()
    for pid in group_members(os.getpgrp()):
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait_for_server(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT in the keeper: nothing to do, the server got the same signal."""


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def run(owner: int, cmd: Sequence[str]) -> int:
    """Start ``cmd`` and keep it; returns its exit status (128 + signal when a signal ended it)."""
    _set_death_signal(signal.SIGUSR1)
    if os.getppid() != owner:  # the owner died before the death signal was armed
        _kill_group()

    def owner_gone(signum: int, frame: object) -> None:
        if os.getppid() != owner:
            _kill_group()

    signal.signal(signal.SIGUSR1, owner_gone)
    # SIGTERM/SIGINT reach the whole group: the server shuts down by itself and the keeper waits for it. A
    # handler, not SIG_IGN: handled signals revert to their default at exec, ignored ones would stay ignored
    # in the server.
    signal.signal(signal.SIGTERM, _wait_for_server)
    signal.signal(signal.SIGINT, _wait_for_server)
    child = subprocess.Popen(list(cmd), preexec_fn=_server_dies_with_keeper)
    while True:
        try:
            rc = child.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            if os.getppid() != owner:
                _kill_group()
    _kill_leftovers()
    return _exit_status(rc)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        raise SystemExit("usage: python -m evaluators.serving.keeper OWNER_PID -- COMMAND [ARGS...]")
    sys.exit(run(int(args[0]), args[2:]))


if __name__ == "__main__":
    main()
