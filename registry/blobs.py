"""Content-addressed blob store on the local filesystem: ``blobs/sha256/<aa>/<digest>``.

Writes are atomic: bytes go to a unique ``tmp/*.incomplete`` file while being
hashed, are fsynced, then renamed into place. A blob that already exists is
not written again (identical files across variants are stored once). Free
space is checked before a copy starts, and ENOSPC becomes :class:`DiskFullError`
with the temp file removed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import DiskFullError, IntegrityError, NotFoundError

CHUNK = 4 << 20


@dataclass(frozen=True)
class StoredBlob:
    sha256: str
    size: int
    created: bool  # False when an identical blob was already present


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBlobStore:
    """Blobs under ``root``. Safe for several processes: every write is a rename of a unique temp file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"

    def path_of(self, sha256: str) -> Path:
        return self.root / "sha256" / sha256[:2] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path_of(sha256).is_file()

    def _check_space(self, size: int) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.tmp).free
        if size > free:
            raise DiskFullError(self.root, needed=size, free=free)

    def put_file(self, src: Path) -> StoredBlob:
        """Hash ``src`` while copying it into the store (one pass); returns its digest and size.

        Raises:
            DiskFullError: not enough space for the copy (nothing is left behind).
        """
        size = src.stat().st_size
        self._check_space(size)
        with src.open("rb") as fh:
            return self._put_stream(fh, expected_size=size)

    def _put_stream(self, fh: BinaryIO, expected_size: int | None = None) -> StoredBlob:
        self.tmp.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self.tmp, suffix=".incomplete")
        tmp_path = Path(tmp_name)
        h = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := fh.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            final = self.path_of(digest)
            if final.is_file() and final.stat().st_size == size:
                tmp_path.unlink()
                return StoredBlob(digest, size, created=False)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(tmp_path, 0o444)
            os.replace(tmp_path, final)
            _fsync_dir(final.parent)
            return StoredBlob(digest, size, created=True)
        except OSError as exc:
            tmp_path.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise DiskFullError(self.root, needed=expected_size) from exc
            raise
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise

    def open(self, sha256: str) -> BinaryIO:
        path = self.path_of(sha256)
        if not path.is_file():
            raise NotFoundError(f"blob {sha256} is missing from {self.root}",
                                hint="run `quantyard registry verify` to list damaged versions")
        return path.open("rb")

    def iter_verified(self, sha256: str, size: int | None = None) -> Iterator[bytes]:
        """Yield the blob's bytes; raise :class:`IntegrityError` at the end if they do not hash to ``sha256``.

        Callers that stream to a user must treat the error as fatal for what they wrote so far.
        """
        h = hashlib.sha256()
        n = 0
        with self.open(sha256) as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
                n += len(chunk)
                yield chunk
        if h.hexdigest() != sha256 or (size is not None and n != size):
            raise IntegrityError(
                f"blob {sha256[:16]}… is corrupt: expected sha256 {sha256} and {size} bytes, "
                f"found sha256 {h.hexdigest()} and {n} bytes",
                hint="restore it from a replica or rebuild the version; `quantyard registry verify --deep` "
                     "lists every affected version",
            )

    def export(self, sha256: str, size: int, dest: Path) -> None:
        """Copy a blob to ``dest`` atomically, verifying sha256 while streaming."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".incomplete")
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in self.iter_verified(sha256, size):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp_name, dest)
        except OSError as exc:
            Path(tmp_name).unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise DiskFullError(dest.parent, needed=size) from exc
            raise
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

    def list_digests(self) -> Iterator[str]:
        base = self.root / "sha256"
        if not base.is_dir():
            return
        for sub in sorted(base.iterdir()):
            for blob in sorted(sub.iterdir()):
                yield blob.name

    def stale_temp_files(self, older_than_s: float) -> list[Path]:
        if not self.tmp.is_dir():
            return []
        cutoff = time.time() - older_than_s
        return [p for p in self.tmp.iterdir() if p.stat().st_mtime < cutoff]

    def delete(self, sha256: str) -> None:
        self.path_of(sha256).unlink(missing_ok=True)
