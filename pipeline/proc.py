"""Run tool subprocesses (converters, engine runners) with contained failures.

A child runs in its own process group, so a timeout kills it and everything it
spawned. Its stderr is streamed to a log file and the tail is kept for error
messages. Signals, out-of-memory kills and non-zero exits become a
:class:`ProcResult` the caller maps to its typed error.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TAIL_BYTES = 6000
_PR_SET_PDEATHSIG = 1

# Looked up before any fork: the child only makes the call (no allocation, no import).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the child, before exec: ask the kernel to SIGKILL us when our parent dies, so a crashed or
    killed flow never leaves converters or engines running (and writing) behind it."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass(frozen=True)
class ProcResult:
    returncode: int
    stdout_tail: str
    stderr_tail: str
    wall_s: float
    timed_out: bool
    log: Path | None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        if self.returncode < 0:
            sig = signal.Signals(-self.returncode).name
            extra = " (killed: out of memory or by another process)" if sig == "SIGKILL" else ""
            return f"died from {sig}{extra}"
        return f"exited with code {self.returncode}"

    @property
    def disk_full(self) -> bool:
        text = self.stderr_tail + self.stdout_tail
        return "No space left on device" in text or "ENOSPC" in text


def _tail(path: Path) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - TAIL_BYTES))
        return fh.read().decode("utf-8", errors="replace")


def child_env(extra: Mapping[str, str] | None = None, pythonpath: Sequence[Path] = ()) -> dict[str, str]:
    """Environment for a child: ours, plus the repo root on PYTHONPATH so ``-m evaluators.runners.x``
    imports from any interpreter, plus ``extra``."""
    env = dict(os.environ)
    paths = [str(p) for p in (*pythonpath, REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


def with_path_prefix(env: Mapping[str, str], name: str, prefix: Path) -> dict[str, str]:
    """Return ``env`` with ``prefix`` prepended to the path-list variable ``name``."""
    out = dict(env)
    out[name] = f"{prefix}{os.pathsep}{out[name]}" if out.get(name) else str(prefix)
    return out


def run_logged(cmd: Sequence[str], *, log_dir: Path, name: str, timeout_s: float,
               env: Mapping[str, str] | None = None, stdin_text: str | None = None,
               cwd: Path | None = None) -> ProcResult:
    """Run ``cmd`` to completion with stdout/stderr in ``log_dir/name.{out,err}``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    started = time.perf_counter()
    timed_out = False
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, env=dict(env) if env is not None else None,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent,
        )
        try:
            proc.communicate(stdin_text.encode() if stdin_text is not None else None, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        except BaseException:
            _kill_group(proc)  # Ctrl-C or a cancelled flow must not leave orphans behind
            raise
    return ProcResult(returncode=proc.returncode, stdout_tail=_tail(out_path), stderr_tail=_tail(err_path),
                      wall_s=time.perf_counter() - started, timed_out=timed_out, log=err_path)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
