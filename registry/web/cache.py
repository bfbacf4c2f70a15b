"""A small response cache for pages and JSON reads, keyed on the registry's generation stamp.

Reads outnumber writes by far, and a model page with hundreds of variants costs tens of milliseconds to
build. Each cached body is stored with the stamp (:meth:`Registry.generation`) it was built under and
served while the stamp is unchanged and the entry is younger than ``ttl_s`` (the TTL bounds staleness
where the stamp alone cannot see a commit: see :func:`registry.listing.generation`). Checking the stamp
is one indexed query. Every cached response carries a weak ETag, so browsers revalidate with a 304.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request, Response

from registry.store import Registry


@dataclass(frozen=True)
class Entry:
    generation: str
    created: float
    body: bytes
    media_type: str
    etag: str


class ResponseCache:
    """LRU of rendered responses; ``max_entries=0`` disables it (every request is built afresh)."""

    def __init__(self, max_entries: int = 256, ttl_s: float = 10.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _get(self, key: str, generation: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.generation != generation or time.monotonic() - entry.created > self.ttl_s:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def _put(self, key: str, entry: Entry) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def respond(self, request: Request, reg: Registry, build: Callable[[], Response]) -> Response:
        """The cached response for this request (method, host, path, query), or ``build()``'s, cached
        when it is a 200. Honours ``If-None-Match`` with the entry's ETag."""
        generation = reg.generation()
        key = f"{request.method} {request.headers.get('host', '')} {request.url.path}?{request.url.query}"
        entry = self._get(key, generation) if self.max_entries else None
        if entry is None:
            response = build()
            if response.status_code != 200 or not isinstance(response.body, bytes):
                return response
            tag = hashlib.sha256(f"{key} {generation}".encode()).hexdigest()[:32]
            entry = Entry(generation, time.monotonic(), bytes(response.body), response.media_type or "",
                          f'W/"{tag}"')
            if self.max_entries:
                self._put(key, entry)
        headers = {"ETag": entry.etag, "Cache-Control": "no-cache"}
        if request.headers.get("if-none-match") == entry.etag:
            return Response(status_code=304, headers=headers)
        return Response(entry.body, media_type=entry.media_type, headers=headers)
