"""Content-addressed blob stores: ``<root>/sha256/<aa>/<digest>``, temp files under ``<root>/tmp``.

Two implementations share one contract (:class:`BlobStore`):

* :class:`LocalBlobStore` — a folder. Ingest from the same filesystem reflinks the file when the
  filesystem can (copy-on-write, fully independent bytes), else hardlinks it; either way the file is
  hashed once. From another filesystem it hashes while copying, in a single pass. Writes go to a
  unique ``tmp/*.incomplete`` file, are fsynced, then renamed into place.
* :class:`registry.remote.FsspecBlobStore` — any fsspec URL (``s3://bucket/prefix`` via s3fs).

Every full read can be verified while streaming (:meth:`BlobStore.iter_verified`); a mismatch raises
:class:`IntegrityError` after the last chunk, so callers must discard what they wrote.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from pipeline.errors import DiskFullError, IntegrityError, NotFoundError

CHUNK = 8 << 20
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


@dataclass(frozen=True)
class StoredBlob:
    sha256: str
    size: int
    created: bool  # False when an identical blob was already present
    method: str = "copy"  # copy | reflink | hardlink | upload


@dataclass(frozen=True)
class BlobStat:
    """What the store knows about one stored object (a blob or a temp file)."""

    key: str  # the digest for a blob, the store path for a temp file
    size: int
    age_s: float  # seconds since it was last written or re-referenced


class BlobStore(Protocol):
    """What the registry needs from a blob store. Digests are lowercase hex sha256."""

    url: str

    def put_file(self, src: Path) -> StoredBlob: ...
    def exists(self, sha256: str) -> bool: ...
    def stat(self, sha256: str) -> BlobStat | None: ...
    def open(self, sha256: str) -> BinaryIO: ...
    def iter_verified(self, sha256: str, size: int | None = None) -> Iterator[bytes]: ...
    def iter_range(self, sha256: str, start: int, length: int) -> Iterator[bytes]: ...
    def export(self, sha256: str, size: int, dest: Path) -> None: ...
    def rehash(self, sha256: str) -> tuple[str, int]: ...
    def list_blobs(self) -> Iterator[BlobStat]: ...
    def temp_files(self) -> list[BlobStat]: ...
    def remove_temp(self, key: str) -> None: ...
    def delete(self, sha256: str) -> None: ...
    def local_path(self, sha256: str) -> Path | None: ...


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def corrupt_error(sha256: str, size: int | None, found: str, n: int) -> IntegrityError:
    return IntegrityError(
        f"blob {sha256[:16]}… is corrupt: expected sha256 {sha256} and {size} bytes, found sha256 {found} "
        f"and {n} bytes",
        hint="restore it from a replica or rebuild the version; `quantyard registry verify --deep` lists every "
             "affected version")


class StreamingMixin:
    """Verified reads and exports on top of ``open``, shared by every store."""

    def open(self, sha256: str) -> BinaryIO:
        raise NotImplementedError

    def iter_verified(self, sha256: str, size: int | None = None) -> Iterator[bytes]:
        """Yield the blob's bytes; raise :class:`IntegrityError` after the last chunk if they do not hash
        to ``sha256`` (or do not add up to ``size``). Callers that stream to a user must then discard it."""
        h = hashlib.sha256()
        n = 0
        with self.open(sha256) as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
                n += len(chunk)
                yield chunk
        if h.hexdigest() != sha256 or (size is not None and n != size):
            raise corrupt_error(sha256, size, h.hexdigest(), n)

    def iter_range(self, sha256: str, start: int, length: int) -> Iterator[bytes]:
        """Yield ``length`` bytes from offset ``start`` (for HTTP Range requests). A part cannot be
        verified against the digest; whole-file reads go through :meth:`iter_verified`."""
        with self.open(sha256) as fh:
            fh.seek(start)
            left = length
            while left > 0 and (chunk := fh.read(min(CHUNK, left))):
                left -= len(chunk)
                yield chunk
        if left:
            raise IntegrityError(f"blob {sha256[:16]}… is shorter than recorded: {left} bytes missing at the end",
                                 hint="run `quantyard registry verify --deep`")

    def rehash(self, sha256: str) -> tuple[str, int]:
        """Read the whole blob and return (its actual sha256, its size)."""
        h = hashlib.sha256()
        n = 0
        with self.open(sha256) as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
                n += len(chunk)
        return h.hexdigest(), n

    def export(self, sha256: str, size: int, dest: Path) -> None:
        """Copy a blob to ``dest`` atomically, verifying sha256 while streaming; nothing is left on a mismatch."""
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _age(st: os.stat_result, now: float) -> float:
    # ctime moves on link, rename and utime too, so a blob just ingested by hardlink counts as new.
    return max(0.0, now - max(st.st_mtime, st.st_ctime))


class LocalBlobStore(StreamingMixin):
    """Blobs under a folder. Safe for several processes: every write ends in a rename of a unique temp file."""

    def __init__(self, root: Path, *, link: bool = True) -> None:
        self.root = root
        self.tmp = root / "tmp"
        self.link = link
        self.url = str(root)

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def path_of(self, sha256: str) -> Path:
        return self.root / "sha256" / sha256[:2] / sha256

    def local_path(self, sha256: str) -> Path | None:
        return self.path_of(sha256)

    def exists(self, sha256: str) -> bool:
        return self.path_of(sha256).is_file()

    def stat(self, sha256: str) -> BlobStat | None:
        try:
            st = self.path_of(sha256).stat()
        except FileNotFoundError:
            return None
        return BlobStat(sha256, st.st_size, _age(st, time.time()))

    def _check_space(self, size: int) -> None:
        free = shutil.disk_usage(self.tmp).free
        if size > free:
            raise DiskFullError(self.root, needed=size, free=free)

    def put_file(self, src: Path) -> StoredBlob:
        """Store ``src`` and return its digest and size. On the same filesystem the bytes are reflinked
        (or hardlinked) and hashed once; elsewhere they are hashed while being copied (one pass).

        Raises:
            DiskFullError: not enough space for the copy (nothing is left behind).
        """
        self.tmp.mkdir(parents=True, exist_ok=True)
        size = src.stat().st_size
        if self.link and src.stat().st_dev == self.tmp.stat().st_dev:
            linked = self._put_linked(src)
            if linked is not None:
                return linked
        self._check_space(size)
        with src.open("rb") as fh:
            return self._put_stream(fh, expected_size=size)

    def _new_temp(self) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.tmp, suffix=".incomplete")
        os.close(fd)
        return Path(name)

    def _put_linked(self, src: Path) -> StoredBlob | None:
        tmp = self._new_temp()
        method = "reflink"
        try:
            with src.open("rb") as fin, tmp.open("wb") as fout:
                fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        except OSError:
            method = "hardlink"
            tmp.unlink()
            try:
                os.link(src, tmp)
            except OSError:
                return None
        try:
            h = hashlib.sha256()
            with tmp.open("rb") as fh:
                while chunk := fh.read(CHUNK):
                    h.update(chunk)
                os.fsync(fh.fileno())  # the tool that wrote src may not have synced it
                size = fh.tell()
            return self._finalize(tmp, h.hexdigest(), size, method)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _put_stream(self, fh: BinaryIO, expected_size: int | None = None) -> StoredBlob:
        tmp_path = self._new_temp()
        h = hashlib.sha256()
        size = 0
        try:
            with tmp_path.open("wb") as out:
                while chunk := fh.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp_path, 0o444)
            return self._finalize(tmp_path, h.hexdigest(), size, "copy")
        except OSError as exc:
            tmp_path.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise DiskFullError(self.root, needed=expected_size) from exc
            raise
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise

    def _finalize(self, tmp: Path, digest: str, size: int, method: str) -> StoredBlob:
        """Move a complete, synced temp file into place (or drop it when the blob is already there)."""
        final = self.path_of(digest)
        if final.is_file() and final.stat().st_size == size:
            tmp.unlink()
            with contextlib.suppress(OSError):
                os.utime(final)  # re-referenced now: gc's grace period starts again
            return StoredBlob(digest, size, created=False, method=method)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        return StoredBlob(digest, size, created=True, method=method)

    def open(self, sha256: str) -> BinaryIO:
        path = self.path_of(sha256)
        if not path.is_file():
            raise NotFoundError(f"blob {sha256} is missing from {self.root}",
                                hint="run `quantyard registry verify` to list damaged versions")
        return path.open("rb")

    def list_blobs(self) -> Iterator[BlobStat]:
        base = self.root / "sha256"
        if not base.is_dir():
            return
        now = time.time()
        for sub in sorted(base.iterdir()):
            for blob in sorted(sub.iterdir()):
                yield BlobStat(blob.name, (st := blob.stat()).st_size, _age(st, now))

    def temp_files(self) -> list[BlobStat]:
        if not self.tmp.is_dir():
            return []
        now = time.time()
        return [BlobStat(str(p), (st := p.stat()).st_size, _age(st, now)) for p in sorted(self.tmp.iterdir())]

    def remove_temp(self, key: str) -> None:
        path = Path(key)
        if path.parent != self.tmp:
            raise ValueError(f"{key} is not a temp file of {self.root}")
        path.unlink(missing_ok=True)

    def delete(self, sha256: str) -> None:
        self.path_of(sha256).unlink(missing_ok=True)
