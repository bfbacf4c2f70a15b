"""File downloads over HTTP: one registered file of one version, by name, with Range and an ETag.

* The file is looked up by its registered name in the version's file list; nothing in the URL ever
  becomes a filesystem path, so ``..``, absolute paths and encoded slashes can only fail to match.
* ``ETag`` is the file's sha256 (quoted, as HTTP requires); ``If-None-Match`` answers 304 and
  ``If-Range`` falls back to the whole file when it names another digest.
* A whole-file download is verified while it streams. The last chunk is held back until the digest
  matched, so a corrupt blob is never delivered complete: the client sees the connection end before
  ``Content-Length`` bytes and treats the download as failed. A Range response cannot be hashed; only
  its length is checked (``Registry.open_file``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from pipeline.errors import IntegrityError
from registry.store import Registry
from registry.views import FileView

log = logging.getLogger("quantyard.web")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RangeNotSatisfiable(Exception):
    """The requested range lies outside the file (HTTP 416)."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The single byte range ``(first, last)`` (inclusive) asked for, or None to send the whole file.

    Malformed headers, other units and multi-range requests are ignored, as RFC 9110 allows.
    Raises RangeNotSatisfiable for a range that starts past the end, or an empty suffix.
    """
    if not header:
        return None
    m = _RANGE_RE.match(header.strip())
    if m is None:
        return None
    first, last = m.group(1), m.group(2)
    if not first and not last:
        return None
    if not first:  # suffix: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable
        return max(0, size - n), size - 1
    a = int(first)
    b = int(last) if last else None
    if b is not None and b < a:
        return None  # syntactically invalid: ignore
    if a >= size:
        raise RangeNotSatisfiable
    return a, size - 1 if b is None else min(b, size - 1)


def held_back(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Yield each chunk once the next one was read: the last one only after the source finished
    without raising (for a verified read, after the digest matched)."""
    pending: bytes | None = None
    for chunk in chunks:
        if pending is not None:
            yield pending
        pending = chunk
    if pending is not None:
        yield pending


class VerifiedStreamingResponse(StreamingResponse):
    """A streamed download that, when the blob turns out corrupt, logs one line and returns without
    completing the response: uvicorn then closes the connection short of ``Content-Length`` (no
    traceback; the client sees a truncated, failed transfer)."""

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except IntegrityError as exc:
            log.error("download aborted before its last chunk: %s", exc.message)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def etag_of(f: FileView) -> str:
    return f'"{f.sha256}"'


def _matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    tags = {t.strip().removeprefix("W/") for t in header.split(",")}
    return "*" in tags or etag in tags


def file_response(request: Request, reg: Registry, ref: str, name: str) -> Response:
    """The HTTP response for ``GET``/``HEAD`` of file ``name`` of version ``ref``.

    Raises NotFoundError for an unknown version or file name (a 404 for the caller to render).
    """
    # One lookup: open_file returns the file's record and a generator that opens nothing until iterated,
    # so a HEAD, a 304 or a Range request never reads the whole blob. A range is read by digest, so it
    # comes from the same bytes the ETag names even if an alias moves meanwhile.
    f, whole = reg.open_file(ref, name)
    etag = etag_of(f)
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "Cache-Control": "public, max-age=31536000, immutable"
               if "@" in ref and ref.rsplit("@", 1)[1].isdigit() else "no-cache",
               "Content-Disposition": f"attachment; filename*=UTF-8''{quote(name.rsplit('/', 1)[-1])}",
               "X-Content-Type-Options": "nosniff"}
    if _matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    if_range = request.headers.get("if-range")
    try:
        span = parse_range(request.headers.get("range"), f.size) if if_range in (None, etag) else None
    except RangeNotSatisfiable:
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{f.size}"})
    status, length = (200, f.size) if span is None else (206, span[1] - span[0] + 1)
    headers["Content-Length"] = str(length)
    if span is not None:
        headers["Content-Range"] = f"bytes {span[0]}-{span[1]}/{f.size}"
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers, media_type="application/octet-stream")
    chunks = whole if span is None else reg.blobs.iter_range(f.sha256, span[0], length)
    return VerifiedStreamingResponse(held_back(chunks), status_code=status, headers=headers,
                             media_type="application/octet-stream")
