"""Blobs on object storage: a real S3-compatible HTTP server (moto's standalone server on loopback),
reached through s3fs. Ingest, pull, verify (and its corruption finding), gc, and the local cache
engines read from, with SQLite and PostgreSQL metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
import s3fs

from pipeline.errors import IntegrityError
from registry import Registry, open_registry
from registry.integrity import gc, verify
from registry.views import RegisterRequest
from tests.registry.helpers import request
from tests.registry.servers import PostgresServer, S3Server


def _open(kind: str, tmp_path: Path, s3: S3Server, request_: pytest.FixtureRequest) -> tuple[Registry, str]:
    prefix = s3.new_prefix()
    if kind == "sqlite":
        return open_registry(str(tmp_path / "registry"), blobs=prefix, blobs_options=s3.options), prefix
    server: PostgresServer = request_.getfixturevalue("pg_server")
    db = server.new_database(template=request_.getfixturevalue("pg_template"))
    return open_registry(server.url(db), blobs=prefix, blobs_options=s3.options), prefix


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_ingest_pull_verify_on_s3(kind: str, tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest) -> None:
    reg, prefix = _open(kind, tmp_path, s3, request)
    data = bytes(range(256)) * 64
    a = reg.register_version(request_(tmp_path, "F16", data))
    reg.register_version(request_(tmp_path, "BF16", data))  # same bytes: stored once
    b = reg.register_version(request_(tmp_path, "Q8_0", b"q8" * 999))
    fs = s3fs.S3FileSystem(**s3.options)
    stored = sorted(p.rsplit("/", 1)[-1] for p in fs.find(prefix.removeprefix("s3://") + "/sha256"))
    assert stored == sorted({a.files[0].sha256, b.files[0].sha256})
    assert fs.find(prefix.removeprefix("s3://") + "/tmp") == []

    (out,) = reg.pull("demo/F16@1", tmp_path / "out")
    assert out.read_bytes() == data
    _, part = reg.open_file("demo/Q8_0", "demo-Q8_0.gguf", start=2, end=5)
    assert b"".join(part) == b"q8q8"
    cached = reg.link_files("demo/F16", tmp_path / "model")[0]
    assert cached.is_symlink() and cached.read_bytes() == data  # engines read a verified local copy
    assert verify(reg, deep=True, grace_s=0).ok

    key = prefix.removeprefix("s3://") + f"/sha256/{a.files[0].sha256[:2]}/{a.files[0].sha256}"
    bad = bytearray(data)
    bad[77] ^= 0x01
    fs.pipe_file(key, bytes(bad))
    assert verify(reg, grace_s=0).ok  # same size: only --deep re-hashes
    report = verify(reg, deep=True, grace_s=0)
    assert [(p.problem, p.sha256) for p in report.problems] == [("corrupt", a.files[0].sha256)]
    assert report.broken_versions == ["demo/BF16@1", "demo/F16@1"]
    with pytest.raises(IntegrityError):
        reg.pull("demo/BF16", tmp_path / "out2")
    assert not (tmp_path / "out2" / "demo-BF16.gguf").exists()


def test_gc_on_s3(tmp_path: Path, s3: S3Server, request: pytest.FixtureRequest) -> None:
    reg, prefix = _open("sqlite", tmp_path, s3, request)
    kept = reg.register_version(request_(tmp_path, "Q8_0", b"kept"))
    src = tmp_path / "orphan.bin"
    src.write_bytes(b"orphan bytes")
    orphan = reg.blobs.put_file(src)
    fs = s3fs.S3FileSystem(**s3.options)
    fs.pipe_file(prefix.removeprefix("s3://") + "/tmp/dead.incomplete", b"half")
    assert gc(reg).blobs == []  # within the grace period
    report = gc(reg, grace_s=0)
    assert report.blobs == [orphan.sha256] and len(report.temp_files) == 1
    assert not reg.blobs.exists(orphan.sha256) and reg.blobs.exists(kept.files[0].sha256)
    assert verify(reg, deep=True, grace_s=0).ok


def request_(tmp: Path, name: str, data: bytes) -> RegisterRequest:
    return request(tmp, name=name, data=data)
