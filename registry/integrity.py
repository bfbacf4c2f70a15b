"""Integrity of a registry: ``verify`` (every referenced blob present, right size, and with ``deep``
the right sha256; no orphans) and ``gc`` (remove unreferenced blobs and stale temp files).

Both honour a grace period: an unreferenced blob or temp file younger than it may belong to a
writer that is still registering, so ``verify`` lists it as in flight and ``gc`` leaves it alone.
``gc`` deletes under the lock every writer's commit takes (see ``Registry._write``), and writers
re-check their blobs under that lock, so a blob is never deleted from under a commit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field
from sqlalchemy import select, union
from sqlalchemy.orm import Session

from registry import sql

if TYPE_CHECKING:
    from registry.store import Registry

Problem = Literal["missing", "size_mismatch", "corrupt", "orphan", "stale_temp"]
BROKEN: frozenset[str] = frozenset({"missing", "size_mismatch", "corrupt"})


class BlobProblem(BaseModel):
    sha256: str  # the digest, or the temp file's path for stale_temp
    problem: Problem
    expected_size: int | None = None
    found_size: int | None = None
    found_sha256: str | None = None
    used_by: list[str] = Field(default_factory=list)  # version refs with file names, artifacts


class VerifyReport(BaseModel):
    blobs_url: str
    deep: bool
    checked: int  # referenced blobs checked
    bytes_checked: int
    problems: list[BlobProblem] = Field(default_factory=list)
    in_flight: list[str] = Field(default_factory=list)  # unreferenced but younger than the grace period

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def broken_versions(self) -> list[str]:
        """Versions (``MODEL/VARIANT@N``) that use a missing, truncated or corrupt blob."""
        refs = {u.split(":", 1)[0] for p in self.problems if p.problem in BROKEN for u in p.used_by
                if not u.startswith("artifact ")}
        return sorted(refs)


class GcReport(BaseModel):
    dry_run: bool
    blobs: list[str] = Field(default_factory=list)  # removed (or, dry run, to remove)
    bytes: int = 0
    temp_files: list[str] = Field(default_factory=list)
    blob_rows: list[str] = Field(default_factory=list)  # blob rows no version or artifact references
    kept_young: int = 0  # unreferenced, but younger than the grace period


def referenced(session: Session) -> dict[str, int]:
    """sha256 -> recorded size of every blob a version file or a source artifact references."""
    refs = union(select(sql.VersionFile.sha256, sql.VersionFile.size),
                 select(sql.SourceArtifact.sha256, sql.SourceArtifact.size)).subquery()
    return {sha: int(size) for sha, size in session.execute(select(refs.c.sha256, refs.c.size))}


def users(session: Session, digests: set[str]) -> dict[str, list[str]]:
    """sha256 -> what uses it: ``MODEL/VARIANT@N:FILE`` and ``artifact KIND KEY of SOURCE``."""
    out: dict[str, list[str]] = {d: [] for d in digests}
    if not digests:
        return out
    rows = session.execute(select(sql.VersionFile.sha256, sql.VersionFile.name, sql.Version.number,
                                  sql.Variant.name, sql.Model.name)
                           .join(sql.Version, sql.VersionFile.version_id == sql.Version.id)
                           .join(sql.Variant).join(sql.Model).where(sql.VersionFile.sha256.in_(digests))
                           .order_by(sql.Model.name, sql.Variant.name, sql.Version.number))
    for sha, fname, number, variant, model in rows:
        out[sha].append(f"{model}/{variant}@{number}:{fname}")
    arts = session.execute(select(sql.SourceArtifact.sha256, sql.SourceArtifact.kind, sql.SourceArtifact.key,
                                  sql.Source.identity).join(sql.Source)
                           .where(sql.SourceArtifact.sha256.in_(digests)))
    for sha, kind, key, identity in arts:
        out[sha].append(f"artifact {kind} {key[:12]} of {identity}")
    return out


def _check_blob(reg: Registry, sha: str, size: int, deep: bool) -> BlobProblem | None:
    st = reg.blobs.stat(sha)
    if st is None:
        return BlobProblem(sha256=sha, problem="missing", expected_size=size)
    if st.size != size:
        return BlobProblem(sha256=sha, problem="size_mismatch", expected_size=size, found_size=st.size)
    if deep:
        found, n = reg.blobs.rehash(sha)
        if found != sha or n != size:
            return BlobProblem(sha256=sha, problem="corrupt", expected_size=size, found_size=n, found_sha256=found)
    return None


def verify(reg: Registry, *, deep: bool = False, grace_s: float = 3600.0) -> VerifyReport:
    """Check every referenced blob, then list unreferenced blobs and leftover temp files."""
    with reg._read() as session:
        refs = referenced(session)
    report = VerifyReport(blobs_url=reg.blobs.url, deep=deep, checked=len(refs), bytes_checked=sum(refs.values()))
    for sha, size in sorted(refs.items()):
        problem = _check_blob(reg, sha, size, deep)
        if problem is not None:
            report.problems.append(problem)
    for st in reg.blobs.list_blobs():
        if st.key in refs:
            continue
        if st.age_s >= grace_s:
            report.problems.append(BlobProblem(sha256=st.key, problem="orphan", found_size=st.size))
        else:
            report.in_flight.append(st.key)
    for st in reg.blobs.temp_files():
        if st.age_s >= grace_s:
            report.problems.append(BlobProblem(sha256=st.key, problem="stale_temp", found_size=st.size))
        else:
            report.in_flight.append(st.key)
    with reg._read() as session:
        used = users(session, {p.sha256 for p in report.problems if p.problem in BROKEN})
    for p in report.problems:
        p.used_by = used.get(p.sha256, [])
    return report


def gc(reg: Registry, *, dry_run: bool = False, grace_s: float = 3600.0) -> GcReport:
    """Remove unreferenced blob rows, unreferenced blobs and stale temp files older than ``grace_s``."""
    report = GcReport(dry_run=dry_run)
    with reg._read() as session:
        refs = referenced(session)
    candidates = []
    for st in reg.blobs.list_blobs():
        if st.key in refs:
            continue
        if st.age_s >= grace_s:
            candidates.append(st.key)
        else:
            report.kept_young += 1
    with reg._write(gc_lock="exclusive") as session:
        # Under the lock no writer can commit: re-read what is referenced, then delete.
        refs = referenced(session)
        rows = session.scalars(select(sql.Blob).where(
            ~select(sql.VersionFile.id).where(sql.VersionFile.sha256 == sql.Blob.sha256).exists(),
            ~select(sql.SourceArtifact.id).where(sql.SourceArtifact.sha256 == sql.Blob.sha256).exists())).all()
        report.blob_rows = sorted(r.sha256 for r in rows)
        for sha in candidates:
            current = reg.blobs.stat(sha)
            if sha in refs or current is None or current.age_s < grace_s:
                continue
            report.blobs.append(sha)
            report.bytes += current.size
            if not dry_run:
                reg.blobs.delete(sha)
        if not dry_run:
            for r in rows:
                session.delete(r)
    for st in reg.blobs.temp_files():
        if st.age_s >= grace_s:
            report.temp_files.append(st.key)
            if not dry_run:
                reg.blobs.remove_temp(st.key)
    return report
