"""Atomic file writes: the one way Quantyard writes a file that another process may read.

A reader sees the old file or the whole new one, never a partial write: the bytes go to a unique
``NAME.<pid>-<random>.incomplete`` beside the target (same filesystem), are flushed and fsync'ed, then
``os.replace`` puts them in place. A killed writer leaves only its ``*.incomplete`` file (or folder), which
``flows.steps.sweep_stale`` removes once its pid is gone.

Also :func:`dir_size`, the bytes a cached folder holds (tool environments, work-folder entries).

Standard library only: workers and runners import it in foreign interpreters (``pipeline/__init__.py``
imports nothing either).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_INCOMPLETE = re.compile(r"\.(\d+)(?:-[0-9a-f]+)?\.incomplete(?:\.[A-Za-z0-9]+)?$")


def incomplete_path(path: Path, suffix: str = "") -> Path:
    """A unique temporary name beside ``path``: ``NAME.<pid>-<random>.incomplete``, plus ``suffix`` for a tool
    that picks its output format by the file's extension (llama-imatrix: ``.gguf``)."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.incomplete{suffix}")


def incomplete_pid(path: Path) -> int | None:
    """The pid of the process that writes the ``*.incomplete`` file or folder ``path`` (None: not such a
    name)."""
    m = _INCOMPLETE.search(path.name)
    return int(m.group(1)) if m else None


def replace_atomic(tmp: Path, path: Path, *, fsync: bool = True) -> Path:
    """Put the finished file (or folder) ``tmp``, written on ``path``'s filesystem, in place of ``path``: its
    bytes are fsync'ed first (files), then one ``os.replace``. Returns ``path``."""
    if fsync and tmp.is_file():
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)
    return path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: Path, *, fsync: bool = True, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path (nothing there yet) to write ``path``'s new content to, by any means: a tool, a
    library, a file or a whole folder. On success it replaces ``path`` (a folder replaces only a missing or
    empty one: ``OSError`` otherwise); on an exception, or a failed replace, it is removed and ``path`` is
    left as it was. ``suffix`` ends the temporary name (see :func:`incomplete_path`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = incomplete_path(path, suffix)
    try:
        yield tmp
        replace_atomic(tmp, path, fsync=fsync)
    finally:
        _remove(tmp)


def write_atomic(path: Path, data: bytes | str, *, fsync: bool = True) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` atomically; returns ``path``."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(payload)
    return path


def dir_size(path: Path) -> int:
    """Bytes under ``path`` (files only, links not followed); a file's own size when ``path`` is a file."""
    if not path.is_dir():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


@contextmanager
def exclusive(lock_path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing): one holder at a time across processes;
    a second caller waits (calling ``on_wait`` first, to say so). A killed holder's lock goes with its process."""
    with lock_path.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


__all__ = ["atomic_path", "dir_size", "exclusive", "incomplete_path", "incomplete_pid", "replace_atomic",
           "write_atomic"]
