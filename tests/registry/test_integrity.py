"""Integrity under concurrency, crashes and corruption, on SQLite and PostgreSQL: concurrent writers
lose nothing, a killed writer leaves at most orphans that gc removes, and a flipped byte is found
by verify --deep (with the versions using it) and refused by pull."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import IntegrityError
from registry.integrity import gc, verify
from tests.registry.conftest import Backend
from tests.registry.helpers import flip_byte, request

ROOT = Path(__file__).resolve().parents[2]


def _worker(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests.registry.worker", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_two_processes_register_concurrently(tmp_path: Path, backend: Backend) -> None:
    backend.open()
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [_worker("register", "--location", backend.location, "--workdir", str(tmp_path / p), "--prefix", p,
                     "--count", "20", "--barrier", str(barrier)) for p in ("a", "b")]
    deadline = time.monotonic() + 120
    while len(list(barrier.glob("ready-*"))) < 2:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "a worker failed to start"
        time.sleep(0.02)
    (barrier / "go").touch()
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out.decode()[-3000:]
    reg = backend.open()
    versions = reg.list_versions("demo", "Q8_0")
    assert sorted(v.number for v in versions) == list(range(1, 41))
    assert len({v.build_key for v in versions}) == 40
    writers = "".join(v.lineage["built_by"] for v in sorted(versions, key=lambda v: v.number))
    assert sorted(writers) == ["a"] * 20 + ["b"] * 20
    # They did write at the same time: each writer's span of registrations overlaps the other's (with SQLite
    # one may hold the write lock for a while, so the version numbers need not interleave).
    (a0, a1), (b0, b1) = (map(float, (barrier / f"span-{p}").read_text().split()) for p in ("a", "b"))
    assert max(a0, b0) < min(a1, b1), (writers, (a0, a1), (b0, b1))
    assert reg.aliases("demo", "Q8_0") == {"latest": 40}
    assert len([e for e in reg.audit_log("demo", limit=500) if e.action == "register"]) == 40
    assert len(list(reg.blobs.list_blobs())) == 30  # 10 shared + 2 × 10 unique
    code, output = _cli("registry", "verify", "--deep", "--grace", "0", *backend.cli)
    assert code == 0, output
    assert "checked 30 blobs" in output and "clean" in output


@pytest.mark.parametrize("mode", ["commit", "blob"])
def test_killed_writer_leaves_only_orphans(tmp_path: Path, backend: Backend, mode: str) -> None:
    reg = backend.open()
    reg.register_version(request(tmp_path, key="good"))
    marker = tmp_path / "marker"
    proc = _worker("crash", "--location", backend.location, "--workdir", str(tmp_path / "w"), "--mode", mode,
                   "--marker", str(marker))
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert time.monotonic() < deadline, "the worker never reached the crash point"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    report = verify(reg, grace_s=0)
    expected = {"commit": "orphan", "blob": "stale_temp"}[mode]
    assert [p.problem for p in report.problems] == [expected]
    assert report.broken_versions == []
    assert [v.number for v in reg.list_versions("demo", "Q8_0")] == [1]  # nothing half-registered
    code, output = _cli("registry", "verify", "--grace", "0", *backend.cli)
    assert code == 1 and expected in output

    code, output = _cli("registry", "gc", "--dry-run", "--grace", "0", *backend.cli)
    assert code == 0 and "would remove" in output
    assert not verify(reg, grace_s=0).ok
    code, output = _cli("registry", "gc", "--grace", "0", *backend.cli)
    assert code == 0
    assert ("removed 1 blob(s)" if mode == "commit" else "removed 0 blob(s)") in output
    assert ("0 temp file(s)" if mode == "commit" else "1 temp file(s)") in output
    assert verify(reg, deep=True, grace_s=0).ok
    assert reg.register_version(request(tmp_path, key="after", data=b"after")).number == 2


def test_gc_keeps_young_orphans_and_referenced_blobs(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    kept = reg.register_version(request(tmp_path))
    src = tmp_path / "orphan.bin"
    src.write_bytes(b"nobody uses me")
    orphan = reg.blobs.put_file(src)
    report = gc(reg)  # default grace: one hour
    assert report.blobs == [] and report.kept_young == 1
    assert verify(reg).ok and verify(reg).in_flight == [orphan.sha256]
    report = gc(reg, grace_s=0)
    assert report.blobs == [orphan.sha256] and not reg.blobs.exists(orphan.sha256)
    assert reg.blobs.exists(kept.files[0].sha256)


def test_flipped_byte_is_found_and_refused(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    a = reg.register_version(request(tmp_path, name="F16", data=b"weights" * 1000))
    reg.register_version(request(tmp_path, name="BF16", data=b"weights" * 1000))  # same bytes, same blob
    reg.register_version(request(tmp_path, name="Q8_0", data=b"other" * 1000))
    digest = a.files[0].sha256
    blob = reg.blobs.local_path(digest)
    assert blob is not None
    flip_byte(blob, 1234)

    code, output = _cli("registry", "verify", *backend.cli)
    assert code == 0, output  # sizes still match: only a deep check can tell
    code, output = _cli("registry", "verify", "--deep", *backend.cli)
    assert code == 1
    assert f"corrupt {digest}" in output
    assert "demo/BF16@1:demo-BF16.gguf" in output and "demo/F16@1:demo-F16.gguf" in output
    assert "demo/Q8_0" not in output.split("broken versions:")[1]
    report = verify(reg, deep=True)
    assert report.broken_versions == ["demo/BF16@1", "demo/F16@1"]

    code, output = _cli("pull", "demo/F16@1", str(tmp_path / "out"), *backend.cli)
    assert code == 1 and "IntegrityError" in output and "corrupt" in output
    assert not list((tmp_path / "out").glob("*"))
    with pytest.raises(IntegrityError):
        reg.pull("demo/BF16", tmp_path / "out2")


def test_missing_and_truncated_blobs(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    a = reg.register_version(request(tmp_path, name="F16", data=b"a" * 5000))
    b = reg.register_version(request(tmp_path, name="Q8_0", data=b"b" * 5000))
    path_a, path_b = reg.blobs.local_path(a.files[0].sha256), reg.blobs.local_path(b.files[0].sha256)
    assert path_a is not None and path_b is not None
    path_a.unlink()
    path_b.chmod(0o644)
    path_b.write_bytes(b"b" * 10)
    report = verify(reg)
    assert {(p.problem, p.sha256) for p in report.problems} == {("missing", a.files[0].sha256),
                                                                ("size_mismatch", b.files[0].sha256)}
    assert report.broken_versions == ["demo/F16@1", "demo/Q8_0@1"]
