"""Run tool subprocesses (converters, engine runners) with contained failures.

A child runs in its own process group, so a timeout kills it and everything it
spawned. Its stderr is streamed to a log file and the tail is kept for error
messages. Signals, out-of-memory kills and non-zero exits become a
:class:`ProcResult` the caller maps to its typed error.

Logs are written next to the work (often a scratch folder that is removed when the
step ends). When a child fails and the caller passes ``keep``, its ``.out`` and
``.err`` are copied to ``keep`` first, normally ``CACHE_DIR/logs/<run id>/`` (see
:func:`failure_log_dir`), so the path an error message prints still exists
afterwards. Old run folders there are pruned (:func:`prune_logs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.progress import LineWatch, Parser

REPO_ROOT = Path(__file__).resolve().parent.parent
TAIL_BYTES = 6000
_PR_SET_PDEATHSIG = 1
#: This process's run id: the folder under the logs root where its failed children's logs are kept.
RUN_ID = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
#: Kept-log folders beyond the newest KEEP_RUNS, or older than KEEP_DAYS, are removed.
KEEP_RUNS = 50
KEEP_DAYS = 14

# Looked up before any fork: the child only makes the call (no allocation, no import).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> None:
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
    """Environment for a child: ours, plus the repo root on PYTHONPATH so ``-m evaluators.<engine>.runner``
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


def failure_log_dir(logs_root: Path) -> Path:
    """Where this process keeps the logs of failed children: ``LOGS_ROOT/<run id>``."""
    return logs_root / RUN_ID


def prune_logs(logs_root: Path, keep_runs: int = KEEP_RUNS, keep_days: float = KEEP_DAYS) -> list[Path]:
    """Remove run folders under ``logs_root`` beyond the newest ``keep_runs`` or older than ``keep_days``
    (never this process's own); returns what was removed."""
    if not logs_root.is_dir():
        return []
    runs = sorted((p for p in logs_root.iterdir() if p.is_dir() and p.name != RUN_ID),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    cutoff = time.time() - keep_days * 86400
    doomed = [p for i, p in enumerate(runs) if i >= keep_runs - 1 or p.stat().st_mtime < cutoff]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def keep_failed(res: ProcResult, log_dir: Path, name: str, keep: Path) -> ProcResult:
    """Copy a failed child's logs to ``keep`` (a new name if one is taken); the result points there."""
    keep.mkdir(parents=True, exist_ok=True)
    stem, n = name, 1
    while (keep / f"{stem}.err").exists():
        n += 1
        stem = f"{name}-{n}"
    for ext in ("out", "err"):
        src = log_dir / f"{name}.{ext}"
        if src.is_file():
            shutil.copyfile(src, keep / f"{stem}.{ext}")
    prune_logs(keep.parent)
    return replace(res, log=keep / f"{stem}.err")


def run_logged(cmd: Sequence[str], *, log_dir: Path, name: str, timeout_s: float,
               env: Mapping[str, str] | None = None, stdin_text: str | None = None,
               cwd: Path | None = None, keep: Path | None = None, progress: Parser | None = None) -> ProcResult:
    """Run ``cmd`` to completion with stdout/stderr in ``log_dir/name.{out,err}``; if it fails and
    ``keep`` is given, the two files are copied there too and ``log`` names the kept copy. ``progress``: a
    parser of the tool's progress lines (pipeline/progress.py), read from both files while it runs and emitted
    as progress of the innermost open stage."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    started = time.perf_counter()
    timed_out = False
    watch = LineWatch(progress) if progress is not None else None
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, env=dict(env) if env is not None else None,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            cwd=cwd, start_new_session=True, preexec_fn=die_with_parent,
        )
        try:
            if watch is None:
                proc.communicate(stdin_text.encode() if stdin_text is not None else None, timeout=timeout_s)
            else:
                _wait_watching(proc, stdin_text, timeout_s, watch, str(out_path), str(err_path))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        except BaseException:
            _kill_group(proc)  # Ctrl-C or a cancelled flow must not leave orphans behind
            raise
    res = ProcResult(returncode=proc.returncode, stdout_tail=_tail(out_path), stderr_tail=_tail(err_path),
                     wall_s=time.perf_counter() - started, timed_out=timed_out, log=err_path)
    return res if res.ok or keep is None else keep_failed(res, log_dir, name, keep)


def _wait_watching(proc: subprocess.Popen[bytes], stdin_text: str | None, timeout_s: float, watch: LineWatch,
                   *paths: str) -> None:
    """Wait for ``proc`` as ``communicate`` does, reading its logs for progress every half second.

    Raises subprocess.TimeoutExpired after ``timeout_s``."""
    if proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError):  # a child that exits without reading its input
            proc.stdin.write((stdin_text or "").encode())
            proc.stdin.close()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            proc.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            watch.poll(*paths)
            if time.monotonic() >= deadline:
                raise
    watch.poll(*paths)
    watch.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
