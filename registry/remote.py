"""A blob store on any fsspec filesystem: ``s3://bucket/prefix`` (s3fs), ``gs://``, ``memory://``...

Same layout and guarantees as the local store: bytes are hashed while they are uploaded to a unique
``tmp/<uuid>.incomplete`` object (one pass), then moved to ``sha256/<aa>/<digest>``. An object store
makes each object appear whole, so a crash leaves at worst a temp object that ``gc`` removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import fsspec

from pipeline.errors import NotFoundError, RegistryError
from registry.blobs import CHUNK, BlobStat, StoredBlob, StreamingMixin


def _age(info: dict[str, Any], now: float) -> float:
    for key in ("LastModified", "mtime", "created", "last_modified", "updated"):
        value = info.get(key)
        if isinstance(value, datetime):
            return max(0.0, now - value.timestamp())
        if isinstance(value, int | float):
            return max(0.0, now - float(value))
    return 0.0  # unknown age counts as new, so gc never removes it


class FsspecBlobStore(StreamingMixin):
    """Blobs under an fsspec URL. ``options`` are fsspec storage options (endpoint, credentials...)."""

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        try:
            self.fs, base = fsspec.core.url_to_fs(self.url, **(options or {}))
        except (ImportError, ValueError) as exc:
            raise RegistryError(f"cannot open blob store {url!r}: {exc}",
                                hint="install the fsspec backend for this scheme (s3fs for s3://)") from exc
        self.base = base.rstrip("/")

    def __repr__(self) -> str:
        return f"FsspecBlobStore({self.url!r})"

    def path_of(self, sha256: str) -> str:
        return f"{self.base}/sha256/{sha256[:2]}/{sha256}"

    def local_path(self, sha256: str) -> Path | None:
        del sha256
        return None

    def _info(self, path: str) -> dict[str, Any] | None:
        self.fs.invalidate_cache(path)
        try:
            return self.fs.info(path)
        except FileNotFoundError:
            return None

    def exists(self, sha256: str) -> bool:
        return self._info(self.path_of(sha256)) is not None

    def stat(self, sha256: str) -> BlobStat | None:
        info = self._info(self.path_of(sha256))
        return None if info is None else BlobStat(sha256, int(info["size"]), _age(info, time.time()))

    def put_file(self, src: Path) -> StoredBlob:
        """Upload ``src`` while hashing it (one pass), then move it to its content address."""
        tmp = f"{self.base}/tmp/{uuid.uuid4().hex}.incomplete"
        h = hashlib.sha256()
        size = 0
        try:
            with src.open("rb") as fin, self.fs.open(tmp, "wb", block_size=CHUNK) as out:
                while chunk := fin.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            digest = h.hexdigest()
            existed = self.exists(digest)
            # Moving over an existing identical blob refreshes its age, so gc's grace period restarts.
            self.fs.mv(tmp, self.path_of(digest))
        except BaseException:
            self._remove_quietly(tmp)
            raise
        return StoredBlob(digest, size, created=not existed, method="upload")

    def _remove_quietly(self, path: str) -> None:
        with contextlib.suppress(OSError):  # FileNotFoundError included
            self.fs.rm(path)

    def open(self, sha256: str) -> BinaryIO:
        try:
            return self.fs.open(self.path_of(sha256), "rb", block_size=CHUNK)
        except FileNotFoundError:
            raise NotFoundError(f"blob {sha256} is missing from {self.url}",
                                hint="run `quantyard registry verify` to list damaged versions") from None

    def _find(self, sub: str) -> dict[str, dict[str, Any]]:
        self.fs.invalidate_cache()
        try:
            return self.fs.find(f"{self.base}/{sub}", detail=True)
        except FileNotFoundError:
            return {}

    def list_blobs(self) -> Iterator[BlobStat]:
        now = time.time()
        for path, info in sorted(self._find("sha256").items()):
            yield BlobStat(path.rsplit("/", 1)[-1], int(info["size"]), _age(info, now))

    def temp_files(self) -> list[BlobStat]:
        now = time.time()
        return [BlobStat(path, int(info["size"]), _age(info, now)) for path, info in sorted(self._find("tmp").items())]

    def remove_temp(self, key: str) -> None:
        if not key.startswith(f"{self.base}/tmp/"):
            raise ValueError(f"{key} is not a temp file of {self.url}")
        self._remove_quietly(key)

    def delete(self, sha256: str) -> None:
        self._remove_quietly(self.path_of(sha256))
