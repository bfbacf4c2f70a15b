"""A small Hugging Face Hub emulator on loopback, for tests that run the real huggingface_hub client.

It implements exactly the endpoints ``huggingface_hub`` 2.x calls to pin and download a model
snapshot (read from its source: ``HfApi.model_info``, ``HfApi.list_repo_tree``, ``get_hf_file_metadata``
and ``http_get``):

* ``GET  /api/models/{repo}/revision/{rev}``  model info: ``sha`` (the commit) and ``siblings``;
* ``GET  /api/models/{repo}/tree/{rev}[/{path}]``  the file listing (``oid``, ``size``, ``lfs``);
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``  a file, with ``ETag``, ``X-Repo-Commit`` and ``Content-Length``.

Errors carry the ``X-Error-Code`` header the client maps to its exceptions (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``). Gated and private repos require
``Authorization: Bearer <token>``. Every request is logged so tests can assert what was downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".model")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False


@dataclass(frozen=True)
class Refusal:
    status: int
    headers: dict[str, str]


@dataclass
class Request:
    method: str
    kind: str  # info | tree | file
    path: str
    status: int


class HubEmulator:
    """Start with :meth:`start`; add repos with :meth:`push`; read :attr:`requests`."""

    def __init__(self, token: str = "hf_emulator_token") -> None:
        self.token = token
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[Request] = []
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def push(self, repo_id: str, folder: Path, *, branch: str = "main", extra: dict[str, bytes] | None = None,
             gated: bool = False, private: bool = False) -> str:
        """Commit every file of ``folder`` (plus ``extra``) to ``branch``; return the new commit SHA."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        files.update(extra or {})
        repo = self.repos.setdefault(repo_id, HubRepo())
        repo.gated, repo.private = gated, private
        parent = repo.refs.get(branch, "")
        commit = hashlib.sha1((parent + json.dumps(sorted((k, git_blob_oid(v)) for k, v in files.items())))
                              .encode()).hexdigest()
        repo.commits[commit] = files
        repo.refs[branch] = commit
        return commit

    def count(self, kind: str) -> int:
        return sum(1 for r in self.requests if r.kind == kind)

    def start(self) -> HubEmulator:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -- request handling --------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, auth: str | None) -> tuple[int, dict[str, str], bytes, str]:
        path = urlsplit(raw_path).path
        if path.startswith("/api/models/"):
            return self._api(path.removeprefix("/api/models/"), auth)
        parts = path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, name = f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote("/".join(parts[4:]))
            return self._file(method, repo_id, rev, name, auth)
        return 404, {}, b"not found", "other"

    def _api(self, rest: str, auth: str | None) -> tuple[int, dict[str, str], bytes, str]:
        parts = rest.split("/")
        repo_id = "/".join(parts[:2])
        kind = parts[2] if len(parts) > 2 else "revision"
        rev = unquote(parts[3]) if len(parts) > 3 else "main"
        kind = "info" if kind == "revision" else kind
        found = self._lookup(repo_id, rev, auth, gate_files=False)
        if isinstance(found, Refusal):
            return found.status, found.headers, b"", kind
        commit, files = found
        if kind == "info":
            body = {"id": repo_id, "sha": commit, "private": self.repos[repo_id].private,
                    "gated": "manual" if self.repos[repo_id].gated else False,
                    "siblings": [{"rfilename": n} for n in sorted(files)]}
            return 200, {"Content-Type": "application/json"}, json.dumps(body).encode(), kind
        if kind == "tree":
            prefix = unquote("/".join(parts[4:]))
            entries = [_tree_entry(n, d) for n, d in sorted(files.items()) if n.startswith(prefix)]
            return 200, {"Content-Type": "application/json"}, json.dumps(entries).encode(), kind
        return 404, {}, b"unknown api", kind

    def _file(self, method: str, repo_id: str, rev: str, name: str,
              auth: str | None) -> tuple[int, dict[str, str], bytes, str]:
        found = self._lookup(repo_id, rev, auth, gate_files=True)
        if isinstance(found, Refusal):
            return found.status, found.headers, b"", "file"
        commit, files = found
        if name not in files:
            return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, b"", "file"
        data = files[name]
        etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_blob_oid(data)
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": commit, "Content-Length": str(len(data)),
                   "Content-Type": "application/octet-stream"}
        return 200, headers, (b"" if method == "HEAD" else data), "file"

    def _lookup(self, repo_id: str, rev: str, auth: str | None,
                gate_files: bool) -> tuple[str, dict[str, bytes]] | Refusal:
        repo = self.repos.get(repo_id)
        authorised = auth == f"Bearer {self.token}"
        if repo is None or (repo.private and not authorised):
            return Refusal(401, {"X-Error-Code": "RepoNotFound"})
        if repo.gated and gate_files and not authorised:
            return Refusal(401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted"})
        commit = repo.refs.get(rev, rev)
        if commit not in repo.commits:
            return Refusal(404, {"X-Error-Code": "RevisionNotFound"})
        return commit, repo.commits[commit]


def _tree_entry(name: str, data: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "path": name, "size": len(data), "oid": git_blob_oid(data)}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _handler_for(hub: HubEmulator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, method: str) -> None:
            status, headers, body, kind = hub.handle(method, self.path, self.headers.get("Authorization"))
            with hub._lock:
                hub.requests.append(Request(method=method, kind=kind, path=self.path, status=status))
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_HEAD(self) -> None:
            self._serve("HEAD")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
