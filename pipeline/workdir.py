"""The shared work folder (``Settings.work_root``): what it caches, when each entry was last used, and pruning.

Cached entries are content-keyed intermediates that a later run on this machine reuses instead of recomputing:

* ``gguf-base/<key>/``: the base GGUF converted from one source by one llama.cpp build (and the importance
  matrices computed on it); the GGUF converter's ``prepare``;
* ``exl2/<key>/``: an EXL2 measurement of one source and calibration (and, for the reference codec, the
  quantized folders made with it); the EXL2 converter's ``prepare``;
* ``calibration/<sha256>.txt``: imatrix calibration texts, by content;
* ``gguf-parity/<key>.json``: recorded tokenizer agreements (one per tokenizer metadata digest, texts and tools).

Everything else there is scratch of one process (``tmp/``, ``staging/``, ``serve/``, ``servers/``, files named
``*.incomplete*``): ``flows.steps.sweep_stale`` removes it once its process is gone, and pruning never touches it.

A user of a cached entry marks it used (:func:`mark_used` sets its modification time), so "last used" is the
last run that created or reused it. Every job that may use cached entries (a convert flow, a stage on a
worker, a validation) holds a shared lease on the folder (:func:`lease`, an ``flock`` on ``.lease``) for as long
as it runs; :func:`prune` takes that lease exclusively, so it never removes an entry from under a running job.
A killed job's lease goes with its process. Removing an entry loses nothing that cannot be rebuilt: the next
run that needs it converts, measures or checks again (the registry keeps every registered file).

Like ``quantyard env prune``, pruning is explicit (``quantyard work prune``) and ``--dry-run`` lists first; it
removes entries unused for longer than an age limit, since what a future run will reuse cannot be known here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import WorkInUseError
from pipeline.fs import dir_size

#: Cached kinds: folder under the work root → what one entry is.
CACHED: dict[str, str] = {
    "gguf-base": "base GGUF of a source (and its importance matrices)",
    "exl2": "EXL2 measurement of a source (and the reference codec's quantized folders)",
    "calibration": "calibration text, by content",
    "gguf-parity": "recorded tokenizer agreement",
}
#: Scratch folders of one process each (swept by flows.steps.sweep_stale once the process is gone).
SCRATCH = ("tmp", "staging", "serve", "servers")
LEASE = ".lease"
DAY_S = 86400.0
#: Default age limit of ``quantyard work prune``.
DEFAULT_OLDER_THAN_DAYS = 30.0


@dataclass(frozen=True)
class WorkEntry:
    """One cached entry: its kind (folder), key (name without suffix), path, size and last use (epoch s)."""

    kind: str
    key: str
    path: Path
    size_bytes: int
    last_used: float

    def age_days(self, now: float | None = None) -> float:
        return max(0.0, ((time.time() if now is None else now) - self.last_used) / DAY_S)

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "path": str(self.path), "size_bytes": self.size_bytes,
                "last_used": self.last_used, "age_days": round(self.age_days(now), 3)}


def mark_used(path: Path) -> None:
    """Record that a run created or reused the cached entry ``path`` now (its modification time)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def entries(root: Path) -> list[WorkEntry]:
    """Every cached entry under the work root ``root``, by kind then least recently used first."""
    out: list[WorkEntry] = []
    for kind in CACHED:
        folder = root / kind
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if ".incomplete" in path.name or path.name.startswith("."):
                continue  # being written (or a killed writer's leftover, swept elsewhere)
            try:
                out.append(WorkEntry(kind=kind, key=path.name.split(".", 1)[0], path=path, size_bytes=dir_size(path),
                                     last_used=path.lstat().st_mtime))
            except OSError:
                continue  # removed while listing
    return sorted(out, key=lambda e: (list(CACHED).index(e.kind), e.last_used, e.key))


def scratch_bytes(root: Path) -> int:
    """Bytes in the scratch folders (what running or killed processes hold; not pruned here)."""
    return sum(dir_size(root / name) for name in SCRATCH if (root / name).is_dir())


def _lease_file(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return root / LEASE


@contextlib.contextmanager
def lease(root: Path) -> Iterator[None]:
    """Hold a shared lease on the work folder while a job may use its cached entries (prune waits for none:
    it refuses while any lease is held). Leases nest and coexist; the lock goes with the process."""
    with _lease_file(root).open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def prune(root: Path, older_than_days: float = DEFAULT_OLDER_THAN_DAYS, *, dry_run: bool = False,
          now: float | None = None) -> list[WorkEntry]:
    """Remove the cached entries last used more than ``older_than_days`` ago (0: every one); return them.
    ``dry_run`` only lists them and takes no lock.

    Raises:
        WorkInUseError: a running job holds the work folder's lease (nothing is removed).
        ConfigError: ``older_than_days`` is negative.
    """
    from pipeline.errors import ConfigError

    if older_than_days < 0:
        raise ConfigError(f"--older-than must be 0 or more days; got {older_than_days}",
                          hint="pass 0 to remove every cached entry, or a number of days")
    if not root.is_dir():
        return []
    cutoff = (time.time() if now is None else now) - older_than_days * DAY_S
    if dry_run:
        return [e for e in entries(root) if e.last_used <= cutoff]
    with _lease_file(root).open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkInUseError(root) from None
        try:
            gone = [e for e in entries(root) if e.last_used <= cutoff]
            for entry in gone:
                _remove(entry.path)
            return gone
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
