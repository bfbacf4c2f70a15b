"""The registry: metadata in SQL (SQLite or PostgreSQL), files in a content-addressed blob store.

Semantics (what the API guarantees):

* **Versions are immutable.** Nothing here changes a version's files, spec or lineage after it is
  registered. Version numbers are assigned inside the registering transaction, under the variant's
  row lock (PostgreSQL) or the database write lock (SQLite), so concurrent writers never collide.
* **Files are addressed by sha256** and stored once, however many versions use them.
* **Aliases** are movable names on a version; ``latest`` is maintained automatically. Every alias
  move and every state change is appended to the audit log (who, when, from, to).
* **States** follow :data:`pipeline.specs.VERSION_TRANSITIONS`; anything else raises.
* **Lineage** is stored as edges (``version_inputs``) so it can be walked both ways.

Ordering rule for every write: blobs first (atomic, idempotent), metadata last, in one transaction
that re-checks the blobs under the lock that ``gc`` takes. A crash in between leaves at worst an
orphan blob that ``gc`` removes; a version never points at a missing file.
"""

from __future__ import annotations

import getpass
import random
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, func, or_, select, text
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, selectinload

from pipeline.errors import DiskFullError, IllegalTransitionError, InvalidReferenceError, NotFoundError, RegistryError
from pipeline.results import EvalResult
from pipeline.shown import NOISE_FLOOR_KIND
from pipeline.specs import VERSION_TRANSITIONS, Ref, VersionState, validate_model_name
from registry import listing, sql
from registry.blobs import BlobStore, StoredBlob
from registry.rows import artifact_view, derive_inputs, safe_join, version_loads, version_view
from registry.views import (
    AUTOMATIC_ALIASES,
    ArtifactView,
    AuditView,
    FileView,
    InputView,
    LineageView,
    ModelView,
    RegisterRequest,
    ResultView,
    VariantSummary,
    VariantView,
    VersionView,
)

__all__ = ["ArtifactView", "AuditView", "FileView", "InputView", "LineageView", "ModelView", "RegisterRequest",
           "Registry", "ResultView", "VariantSummary", "VariantView", "VersionView", "actor"]

T = TypeVar("T")
_VARIANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")
GC_LOCK_KEY = 0x51A7_0001  # PostgreSQL advisory lock: writers share it, gc takes it exclusively
RETRIES = 10


def actor() -> str:
    """Who is acting: ``user@host`` of this process."""
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # getuser fails without a passwd entry in some containers
        return f"unknown@{socket.gethostname()}"


class _BlobVanished(Exception):
    """A blob stored before the transaction is gone (gc ran in between): store it again and retry."""


def _retryable(exc: Exception) -> bool:
    if isinstance(exc, SAIntegrityError):
        return True  # a concurrent writer inserted the same model/source/variant/blob first
    code = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return isinstance(exc, OperationalError) and code in ("40001", "40P01")  # serialization, deadlock


def _check_names(req: RegisterRequest) -> None:
    validate_model_name(req.model)
    if not _VARIANT_RE.match(req.variant):
        raise InvalidReferenceError(f"invalid variant name {req.variant!r}: use letters, digits, '.', '_', '-'")


class Registry:
    """Versioned registry API. Obtain one with :func:`registry.open_registry`.

    Every method takes references as ``MODEL/VARIANT[@VERSION|@ALIAS]`` strings or :class:`Ref`.
    Lookups of unknown names raise :class:`NotFoundError`; bad references :class:`InvalidReferenceError`.
    """

    def __init__(self, engine: Engine, blobs: BlobStore, location: str, *, cache_dir: Path | None = None) -> None:
        self.engine = engine
        self.blobs = blobs
        self.location = location
        self.cache_dir = cache_dir or Path(tempfile.gettempdir()) / "quantyard-blob-cache"
        self._write_engine = engine.execution_options(quantyard_write=True)
        self.is_postgres = engine.dialect.name == "postgresql"

    def __repr__(self) -> str:
        return f"Registry({self.location!r}, blobs={self.blobs.url!r})"

    # -- sessions --------------------------------------------------------------------------------

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session:
            yield session

    @contextmanager
    def _write(self, gc_lock: str = "shared") -> Iterator[Session]:
        """A write transaction. SQLite: BEGIN IMMEDIATE takes the one write lock up front. PostgreSQL:
        writers share an advisory lock that ``gc`` takes exclusively while it deletes blobs."""
        try:
            with Session(self._write_engine, expire_on_commit=False) as session, session.begin():
                if self.is_postgres:
                    fn = "pg_advisory_xact_lock" if gc_lock == "exclusive" else "pg_advisory_xact_lock_shared"
                    session.execute(text(f"SELECT {fn}(:key)"), {"key": GC_LOCK_KEY})
                yield session
        except OperationalError as exc:
            # SQLite says "database or disk is full"; PostgreSQL "could not extend file ... No space left".
            text_ = str(exc.orig) if exc.orig is not None else str(exc)
            if "disk is full" in text_ or "No space left" in text_:
                raise DiskFullError(self.location) from exc
            raise

    @staticmethod
    def _retry(fn: Callable[[], T]) -> T:
        for attempt in range(RETRIES):
            try:
                return fn()
            except (SAIntegrityError, OperationalError) as exc:
                if attempt == RETRIES - 1 or not _retryable(exc):
                    raise
                time.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
        raise AssertionError("unreachable")

    # -- lookups ---------------------------------------------------------------------------------

    @staticmethod
    def _model(session: Session, name: str) -> sql.Model:
        model = session.scalar(select(sql.Model).where(sql.Model.name == name))
        if model is None:
            raise NotFoundError(f"model {name!r} is not in the registry", hint="list models with `quantyard models`")
        return model

    def _variant(self, session: Session, model: str, variant: str, *, lock: bool = False) -> sql.Variant:
        m = self._model(session, model)
        query = select(sql.Variant).where(sql.Variant.model_id == m.id, sql.Variant.name == variant)
        row = session.scalar(query.with_for_update() if lock else query)
        if row is None:
            raise NotFoundError(f"variant {variant!r} of model {model!r} is not in the registry",
                                hint=f"list variants with `quantyard variants {model}`")
        return row

    def _version(self, session: Session, ref: Ref, *, lock: bool = False) -> sql.Version:
        variant = self._variant(session, ref.model, ref.variant, lock=lock)
        if ref.version is None:
            alias = session.scalar(select(sql.Alias).where(sql.Alias.variant_id == variant.id,
                                                           sql.Alias.name == (ref.alias or "latest")))
            if alias is None:
                raise NotFoundError(f"alias {ref.alias or 'latest'!r} is not set on {ref.model}/{ref.variant}",
                                    hint=f"list aliases with `quantyard alias list {ref.model}/{ref.variant}`")
            return alias.version
        version = session.scalar(select(sql.Version).where(sql.Version.variant_id == variant.id,
                                                           sql.Version.number == ref.version))
        if version is None:
            raise NotFoundError(f"{ref} does not exist", hint=f"list versions with `quantyard variants {ref.model}`")
        return version

    @staticmethod
    def _parse(ref: Ref | str) -> Ref:
        return Ref.parse(ref) if isinstance(ref, str) else ref

    # -- registering -----------------------------------------------------------------------------

    @staticmethod
    def _ensure_model(session: Session, name: str, architecture: str | None) -> sql.Model:
        model = session.scalar(select(sql.Model).where(sql.Model.name == name))
        if model is None:
            model = sql.Model(name=validate_model_name(name), architecture=architecture)
            session.add(model)
            session.flush()
        elif architecture and not model.architecture:
            model.architecture = architecture
        return model

    @staticmethod
    def _ensure_source(session: Session, model: sql.Model, req_source: Any) -> sql.Source:
        src = session.scalar(select(sql.Source).where(sql.Source.model_id == model.id,
                                                      sql.Source.identity == req_source.identity))
        if src is None:
            src = sql.Source(model_id=model.id, kind=req_source.kind.value, identity=req_source.identity,
                             repo_id=req_source.repo_id, revision=req_source.revision, commit=req_source.commit,
                             path=req_source.path, content_hash=req_source.content_hash)
            session.add(src)
            session.flush()
        return src

    def _ensure_blobs(self, session: Session, stored: Mapping[str, StoredBlob]) -> None:
        """Record the blobs, after checking (under the gc lock) that they are still in the store."""
        for blob in stored.values():
            if not self.blobs.exists(blob.sha256):
                raise _BlobVanished(blob.sha256)
            if session.get(sql.Blob, blob.sha256) is None:
                session.add(sql.Blob(sha256=blob.sha256, size=blob.size))
                session.flush()

    def find_build(self, model: str, variant: str, build_key: str) -> VersionView | None:
        """The newest version of ``model/variant`` built with ``build_key``, if any."""
        with self._read() as session:
            version = session.scalar(
                select(sql.Version).join(sql.Variant).join(sql.Model)
                .where(sql.Model.name == model, sql.Variant.name == variant, sql.Version.build_key == build_key)
                .order_by(sql.Version.number.desc()).limit(1))
            return None if version is None else version_view(session, version)

    def register_version(self, req: RegisterRequest, *, by: str | None = None) -> VersionView:
        """Store the files, then create the next version (state ``candidate``) and move ``latest`` to it,
        in one transaction.

        Re-registering the same ``build_key`` returns the existing version (``created=False``) unless
        ``force`` is set. Raises DiskFullError when the blob store is full (nothing is registered then).
        """
        _check_names(req)
        inputs = derive_inputs(req)
        for _ in range(3):
            stored = {name: self.blobs.put_file(path) for name, path in sorted(req.files.items())}
            try:
                return self._retry(partial(self._insert_version, req, stored, inputs, by or actor()))
            except _BlobVanished:
                continue
        raise RegistryError("blobs kept disappearing while registering: is `quantyard registry gc` running with "
                            "a zero grace period?", hint="re-run with gc stopped")

    def register_stored(self, req: RegisterRequest, stored: Mapping[str, StoredBlob], *,
                        by: str | None = None) -> VersionView:
        """Like :meth:`register_version` for files another process already put in the blob store (a build
        stage on another machine): ``stored`` maps file names to their blobs; ``req.files`` is ignored.

        Raises NotFoundError when a blob is not (or no longer) in the store: nothing is registered then.
        """
        _check_names(req)
        try:
            return self._retry(lambda: self._insert_version(req, stored, derive_inputs(req), by or actor()))
        except _BlobVanished as exc:
            raise NotFoundError(f"blob {exc} of {req.model}/{req.variant} is not in {self.blobs.url}",
                                hint="run the build again: its files were removed before registration") from None

    def _insert_version(self, req: RegisterRequest, stored: Mapping[str, StoredBlob], inputs: list[InputView],
                        who: str) -> VersionView:
        with self._write() as session:
            model = self._ensure_model(session, req.model, req.architecture)
            source = self._ensure_source(session, model, req.source)
            variant = session.scalar(select(sql.Variant).where(sql.Variant.model_id == model.id,
                                                               sql.Variant.name == req.variant).with_for_update())
            if variant is None:
                variant = sql.Variant(model_id=model.id, name=req.variant, format=req.format, spec=req.spec)
                session.add(variant)
                session.flush()
            if not req.force:
                existing = session.scalar(
                    select(sql.Version).where(sql.Version.variant_id == variant.id,
                                              sql.Version.build_key == req.build_key)
                    .order_by(sql.Version.number.desc()).limit(1))
                if existing is not None:
                    return version_view(session, existing, created=False)
            self._ensure_blobs(session, stored)
            number = (session.scalar(select(func.max(sql.Version.number))
                                     .where(sql.Version.variant_id == variant.id)) or 0) + 1
            lineage = dict(req.lineage, registered_by=who, inputs=[i.model_dump() for i in inputs
                                                                   if i.kind not in ("source", "tool")])
            version = sql.Version(variant_id=variant.id, number=number, source_id=source.id,
                                  build_key=req.build_key, state=VersionState.CANDIDATE.value, lineage=lineage)
            session.add(version)
            session.flush()
            for name, blob in stored.items():
                session.add(sql.VersionFile(version_id=version.id, name=name, sha256=blob.sha256, size=blob.size))
            for edge in inputs:
                session.add(sql.VersionInput(version_id=version.id, **edge.model_dump()))
            session.add(sql.AuditEvent(actor=who, action="register", variant_id=variant.id, version_id=version.id,
                                       new=str(number), note=f"build {req.build_key[:16]}"))
            self._move_alias(session, variant, "latest", version, who, note=None)
            session.flush()
            session.refresh(version)
            return version_view(session, version, created=True)

    def add_result(self, ref: Ref | str, record: EvalResult | Mapping[str, Any]) -> int:
        """Attach an evaluation result to a version; returns its id. A mapping is validated as an
        :class:`~pipeline.results.EvalResult` (unknown keys are an error, not silently dropped).

        Raises:
            pydantic.ValidationError: ``record`` is not a valid result.
        """
        ref = self._parse(ref)
        result = record if isinstance(record, EvalResult) else EvalResult.model_validate(dict(record))
        with self._write() as session:
            version = self._version(session, ref)
            row = sql.Result(version_id=version.id, kind=result.kind, engine=result.engine,
                             engine_version=result.engine_version, window_set_id=result.window_set_id,
                             status=result.status, metrics=dict(result.metrics), hardware=dict(result.hardware),
                             error=result.error, wall_s=result.wall_s)
            session.add(row)
            session.flush()
            return row.id

    # -- states and aliases ----------------------------------------------------------------------

    def set_state(self, ref: Ref | str, state: VersionState | str, *, by: str | None = None,
                  note: str | None = None) -> VersionView:
        """Move a version to ``state`` and log it.

        Raises:
            IllegalTransitionError: the move is not in :data:`VERSION_TRANSITIONS`.
        """
        ref, state = self._parse(ref), VersionState(state)
        with self._write() as session:
            version = self._version(session, ref, lock=True)
            current = VersionState(version.state)
            if state not in VERSION_TRANSITIONS[current]:
                allowed = ", ".join(sorted(s.value for s in VERSION_TRANSITIONS[current])) or "none (final state)"
                raise IllegalTransitionError(
                    f"{ref} cannot go from {current.value} to {state.value}; allowed from {current.value}: {allowed}")
            version.state = state.value
            session.add(sql.AuditEvent(actor=by or actor(), action="state", variant_id=version.variant_id,
                                       version_id=version.id, old=current.value, new=state.value, note=note))
            session.flush()
            return version_view(session, version)

    @staticmethod
    def _move_alias(session: Session, variant: sql.Variant, name: str, version: sql.Version | None, who: str,
                    note: str | None) -> int | None:
        row = session.scalar(select(sql.Alias).where(sql.Alias.variant_id == variant.id, sql.Alias.name == name))
        old = row.version.number if row is not None else None
        if version is None:
            if row is not None:
                session.delete(row)
        elif row is None:
            session.add(sql.Alias(variant_id=variant.id, name=name, version_id=version.id, updated_by=who))
        else:
            row.version_id, row.updated_by, row.updated_at = version.id, who, sql.utcnow()
        session.add(sql.AuditEvent(actor=who, action="alias.set" if version is not None else "alias.delete",
                                   variant_id=variant.id, version_id=version.id if version is not None else None,
                                   name=name, old=None if old is None else str(old),
                                   new=None if version is None else str(version.number), note=note))
        session.flush()
        return old

    @staticmethod
    def _check_alias_name(name: str) -> None:
        if name in AUTOMATIC_ALIASES:
            raise IllegalTransitionError(f"alias {name!r} is maintained by the registry and cannot be moved by hand")
        if name.isdigit() or not _VARIANT_RE.match(name):
            raise InvalidReferenceError(f"invalid alias {name!r}: expected letters, digits, '.', '_', '-' "
                                        "and not only digits (those are version numbers)")

    def set_alias(self, ref: Ref | str, name: str, *, by: str | None = None, note: str | None = None) -> VersionView:
        """Point alias ``name`` of the variant at the version ``ref`` names (creating or moving it) and log it."""
        ref = self._parse(ref)
        self._check_alias_name(name)

        def run() -> VersionView:
            with self._write() as session:
                variant = self._variant(session, ref.model, ref.variant, lock=True)
                version = self._version(session, ref)
                self._move_alias(session, variant, name, version, by or actor(), note)
                return version_view(session, version)

        return self._retry(run)

    def delete_alias(self, model: str, variant: str, name: str, *, by: str | None = None,
                     note: str | None = None) -> None:
        """Remove alias ``name`` from ``model/variant`` and log it. Raises NotFoundError when it is not set."""
        self._check_alias_name(name)
        with self._write() as session:
            row = self._variant(session, model, variant, lock=True)
            if self._move_alias(session, row, name, None, by or actor(), note) is None:
                raise NotFoundError(f"alias {name!r} is not set on {model}/{variant}")

    def aliases(self, model: str, variant: str) -> dict[str, int]:
        """Aliases of ``model/variant``: name -> version number."""
        with self._read() as session:
            row = self._variant(session, model, variant)
            return {a.name: a.version.number for a in session.scalars(
                select(sql.Alias).where(sql.Alias.variant_id == row.id).order_by(sql.Alias.name))}

    def audit_log(self, model: str | None = None, variant: str | None = None, *, limit: int = 200) -> list[AuditView]:
        """The newest ``limit`` audit events (alias moves, state changes, registrations), newest first."""
        with self._read() as session:
            query = (select(sql.AuditEvent, sql.Variant.name, sql.Model.name, sql.Version.number)
                     .join(sql.Variant, sql.AuditEvent.variant_id == sql.Variant.id).join(sql.Model)
                     .outerjoin(sql.Version, sql.AuditEvent.version_id == sql.Version.id))
            if model is not None:
                query = query.where(sql.Model.name == model)
            if variant is not None:
                query = query.where(sql.Variant.name == variant)
            rows = session.execute(query.order_by(sql.AuditEvent.id.desc()).limit(limit)).all()
            return [AuditView(id=e.id, at=e.created_at.isoformat(), actor=e.actor, action=e.action, model=m,
                              variant=v, version=n, name=e.name, old=e.old, new=e.new, note=e.note)
                    for e, v, m, n in rows]

    # -- lineage ---------------------------------------------------------------------------------

    def lineage(self, ref: Ref | str) -> LineageView:
        """Upstream lineage of a version: source (commit or content hash), tool, environment, inputs."""
        view = self.get_version(ref)
        lin = view.lineage
        return LineageView(ref=view.ref, source={**view.source, **(lin.get("source") or {})}, inputs=view.inputs,
                           tool=lin.get("tool") or {}, parameters=lin.get("parameters") or {},
                           environment={**(lin.get("environment") or {}),
                                        "quantyard_version": lin.get("quantyard_version"),
                                        "registered_by": lin.get("registered_by"), "built_at": lin.get("built_at")},
                           build_key=view.build_key)

    def derived_from(self, ref: str, kind: str | None = None) -> list[VersionView]:
        """Downstream lineage: every version with an input matching ``ref`` — a source identity
        (``hub:owner/name@commit``, ``local:sha256:…``), a tool reference, or an input's sha256 —
        exactly or by prefix (at least 8 characters). Oldest first."""
        if len(ref) < 8:
            raise InvalidReferenceError(f"lineage query {ref!r} is too short: give at least 8 characters")
        pattern = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        with self._read() as session:
            query = select(sql.VersionInput.version_id).where(or_(
                sql.VersionInput.ref.like(pattern, escape="\\"), sql.VersionInput.sha256.like(pattern, escape="\\")))
            if kind is not None:
                query = query.where(sql.VersionInput.kind == kind)
            versions = session.scalars(select(sql.Version).where(sql.Version.id.in_(query.distinct()))
                                       .order_by(sql.Version.id).options(*version_loads())).all()
            return [version_view(session, v) for v in versions]

    # -- source artifacts ------------------------------------------------------------------------

    def find_source_artifact(self, source: Any, kind: str, key: str) -> ArtifactView | None:
        with self._read() as session:
            row = session.scalar(select(sql.SourceArtifact).join(sql.Source)
                                 .where(sql.Source.identity == source.identity, sql.SourceArtifact.kind == kind,
                                        sql.SourceArtifact.key == key).limit(1))
            return None if row is None else artifact_view(row)

    def put_source_artifact(self, *, model: str, architecture: str | None, source: Any, kind: str, key: str,
                            name: str, path: Path, meta: dict[str, Any]) -> ArtifactView:
        """Register a file belonging to a source (idempotent on (source, kind, key))."""
        def run(blob: StoredBlob) -> ArtifactView:
            with self._write() as session:
                m = self._ensure_model(session, model, architecture)
                src = self._ensure_source(session, m, source)
                row = session.scalar(select(sql.SourceArtifact).where(
                    sql.SourceArtifact.source_id == src.id, sql.SourceArtifact.kind == kind,
                    sql.SourceArtifact.key == key))
                if row is None:
                    self._ensure_blobs(session, {name: blob})
                    row = sql.SourceArtifact(source_id=src.id, kind=kind, key=key, name=name, sha256=blob.sha256,
                                             size=blob.size, meta=meta)
                    session.add(row)
                    session.flush()
                session.refresh(row)
                return artifact_view(row)

        for _ in range(3):
            blob = self.blobs.put_file(path)
            try:
                return self._retry(partial(run, blob))
            except _BlobVanished:
                continue
        raise RegistryError("the artifact's blob kept disappearing while registering: is gc running?")

    def list_source_artifacts(self, source_identity: str, kind: str | None = None) -> list[ArtifactView]:
        """Every artifact of a source (window sets, references, imatrix files...), oldest first."""
        with self._read() as session:
            query = (select(sql.SourceArtifact).join(sql.Source).where(sql.Source.identity == source_identity)
                     .order_by(sql.SourceArtifact.id))
            if kind is not None:
                query = query.where(sql.SourceArtifact.kind == kind)
            return [artifact_view(r) for r in session.scalars(query).all()]

    def noise_floors(self, source_identities: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The measured noise floors of sources (flows/steps.py ``ensure_noise_floor``), keyed by the reference
        they were measured against (a quality result's ``reference_key``); the newest where a reference has
        several. A floor that could not be measured (no second run fitted) is not one."""
        out: dict[str, dict[str, Any]] = {}
        for identity in source_identities:
            for art in self.list_source_artifacts(identity, NOISE_FLOOR_KIND):
                if art.meta.get("kld_mean") is not None and art.meta.get("reference_key"):
                    out[str(art.meta["reference_key"])] = dict(art.meta)
        return out

    def artifact_path(self, artifact: ArtifactView) -> Path:
        """Local, read-only path of an artifact's bytes (downloaded and verified first for a remote store)."""
        return self.local_blob(artifact.sha256, artifact.size)

    # -- reads -----------------------------------------------------------------------------------

    def list_models(self, *, architecture: str | None = None, format: str | None = None,
                    query: str | None = None) -> list[ModelView]:
        """Models, by name; optionally only those of one architecture, with a variant of one format, or
        whose name contains ``query`` (case-insensitive). Aggregate queries, whatever the registry's size."""
        with self._read() as session:
            return listing.model_views(session, architecture=architecture, format=format, query=query)

    def generation(self) -> str:
        """An opaque stamp that changes whenever anything a listing shows changes (for caches and ETags)."""
        with self._read() as session:
            return listing.generation(session)

    def list_variants(self, model: str, *, format: str | None = None) -> list[VariantView]:
        """Variants of ``model`` with their version numbers, latest version and its state, and aliases."""
        with self._read() as session:
            m = self._model(session, model)
            query = (select(sql.Variant).where(sql.Variant.model_id == m.id)
                     .options(selectinload(sql.Variant.versions)).order_by(sql.Variant.name))
            if format is not None:
                query = query.where(sql.Variant.format == format)
            aliases: dict[int, dict[str, int]] = {}
            for a, number in session.execute(select(sql.Alias, sql.Version.number).join(sql.Version)
                                             .join(sql.Variant, sql.Alias.variant_id == sql.Variant.id)
                                             .where(sql.Variant.model_id == m.id).order_by(sql.Alias.name)):
                aliases.setdefault(a.variant_id, {})[a.name] = number
            out = []
            for v in session.scalars(query).all():
                latest = max(v.versions, key=lambda x: x.number, default=None)
                out.append(VariantView(model=model, name=v.name, format=v.format, spec=v.spec,
                                       versions=[x.number for x in v.versions],
                                       latest=latest.number if latest else None,
                                       latest_state=latest.state if latest else None, aliases=aliases.get(v.id, {})))
            return out

    def variant_summaries(self, model: str, *, format: str | None = None) -> list[VariantSummary]:
        """Every variant of ``model`` with its latest version, in a fixed number of queries. Raises NotFoundError."""
        with self._read() as session:
            return listing.variant_summaries(session, self._model(session, model), format=format)

    def list_versions(self, model: str, variant: str) -> list[VersionView]:
        """Every version of ``model/variant``, oldest first, with files, results, aliases and lineage edges."""
        with self._read() as session:
            row = self._variant(session, model, variant)
            versions = session.scalars(select(sql.Version).where(sql.Version.variant_id == row.id)
                                       .options(*version_loads()).order_by(sql.Version.number)).all()
            return [version_view(session, v) for v in versions]

    def get_version(self, ref: Ref | str) -> VersionView:
        """One version; without ``@VERSION`` the ``latest`` alias, with ``@ALIAS`` that alias."""
        ref = self._parse(ref)
        with self._read() as session:
            return version_view(session, self._version(session, ref))

    def latest_versions(self, model: str) -> list[VersionView]:
        """The ``latest`` version of every variant of ``model``."""
        return [self.get_version(Ref(model=model, variant=v.name)) for v in self.list_variants(model)
                if v.latest is not None]

    # -- files -----------------------------------------------------------------------------------

    def local_blob(self, sha256: str, size: int) -> Path:
        """A local path holding the blob: the store's own file, or a verified copy in the cache for a
        remote store. Raises NotFoundError when the blob is missing, IntegrityError when it is corrupt."""
        path = self.blobs.local_path(sha256)
        if path is not None:
            if not path.is_file():
                raise NotFoundError(f"blob {sha256} is missing from {self.blobs.url}",
                                    hint="run `quantyard registry verify`")
            return path
        cached = self.cache_dir / "sha256" / sha256[:2] / sha256
        if not (cached.is_file() and cached.stat().st_size == size):
            self.blobs.export(sha256, size, cached)
        return cached

    def open_file(self, ref: Ref | str, name: str, start: int | None = None,
                  end: int | None = None) -> tuple[FileView, Iterator[bytes]]:
        """Stream one file of a version. Without a range the bytes are verified against sha256 while
        streaming (IntegrityError after the last chunk on a mismatch: abort the response). With a range
        (``start``..``end`` inclusive, as in HTTP) only that part is read and its length checked."""
        view = self.get_version(ref)
        f = next((f for f in view.files if f.name == name), None)
        if f is None:
            raise NotFoundError(f"{view.ref} has no file {name!r}",
                                hint="files: " + ", ".join(x.name for x in view.files))
        if start is None and end is None:
            return f, self.blobs.iter_verified(f.sha256, f.size)
        first = start or 0
        last = min(f.size - 1, end if end is not None else f.size - 1)
        if first < 0 or first > last:
            raise InvalidReferenceError(f"range {start}-{end} is outside {name} ({f.size} bytes)")
        return f, self.blobs.iter_range(f.sha256, first, last - first + 1)

    def link_files(self, ref: Ref | str, dest: Path) -> list[Path]:
        """Lay out a version's files under ``dest`` as read-only symlinks to local blobs (a verified
        cache copy for a remote store). For trusted local consumers such as evaluators."""
        view = self.get_version(ref)
        out = []
        for f in view.files:
            target = safe_join(dest, f.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(self.local_blob(f.sha256, f.size))
            out.append(target)
        return out

    def pull(self, ref: Ref | str, dest: Path) -> list[Path]:
        """Copy a version's files into ``dest``, verifying each sha256 while streaming.

        Raises IntegrityError (and leaves no partial file) when a blob does not match.
        """
        view = self.get_version(ref)
        out = []
        for f in view.files:
            target = safe_join(dest, f.name)
            self.blobs.export(f.sha256, f.size, target)
            out.append(target)
        return out

