"""The registry: metadata in SQL (SQLite or PostgreSQL), files in a content-addressed blob store.

Ordering rule for every write: blobs first (atomic, idempotent), metadata last,
in one transaction. A crash in between leaves at worst an orphan blob that
``gc`` removes; it never leaves a version pointing at a missing file.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.orm import Session, selectinload

from pipeline.errors import IllegalTransitionError, NotFoundError, RegistryError
from pipeline.specs import VERSION_TRANSITIONS, Ref, SourceRef, VersionState, validate_model_name
from registry import sql
from registry.blobs import LocalBlobStore


class FileView(BaseModel):
    name: str
    sha256: str
    size: int


class ResultView(BaseModel):
    id: int
    kind: str
    engine: str
    engine_version: str | None
    window_set_id: str | None
    status: str
    metrics: dict[str, Any]
    hardware: dict[str, Any]
    error: str | None
    wall_s: float | None
    created_at: str


class VersionView(BaseModel):
    model: str
    variant: str
    format: str
    spec: dict[str, Any]
    number: int
    state: str
    build_key: str
    created_at: str
    source: dict[str, Any]
    lineage: dict[str, Any]
    files: list[FileView]
    results: list[ResultView]
    created: bool = False  # set by register_version: False when an existing version was reused

    @property
    def ref(self) -> str:
        return f"{self.model}/{self.variant}@{self.number}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


class VariantView(BaseModel):
    model: str
    name: str
    format: str
    spec: dict[str, Any]
    versions: list[int]
    latest: int | None


class ModelView(BaseModel):
    name: str
    architecture: str | None
    variants: int
    versions: int
    created_at: str


class ArtifactView(BaseModel):
    source_identity: str
    kind: str
    key: str
    name: str
    sha256: str
    size: int
    meta: dict[str, Any]


class RegisterRequest(BaseModel):
    """Everything needed to register one immutable version of a variant."""

    model: str
    architecture: str | None = None
    source: SourceRef
    variant: str
    format: str
    spec: dict[str, Any]
    build_key: str
    lineage: dict[str, Any]
    files: dict[str, Path]  # logical name -> path on disk
    force: bool = False


def actor() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # getuser fails without a passwd entry in some containers
        return f"unknown@{socket.gethostname()}"


class Registry:
    """Versioned registry API. Obtain one with :func:`registry.open_registry`."""

    def __init__(self, engine: Engine, blobs: LocalBlobStore, location: str) -> None:
        self.engine = engine
        self.blobs = blobs
        self.location = location
        self._write_engine = engine.execution_options(quantyard_write=True)

    def __repr__(self) -> str:
        return f"Registry({self.location!r})"

    # -- sessions --------------------------------------------------------------------------------

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session:
            yield session

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """A write transaction; on SQLite it takes the write lock up front (BEGIN IMMEDIATE)."""
        with Session(self._write_engine, expire_on_commit=False) as session, session.begin():
            yield session

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _model(session: Session, name: str) -> sql.Model:
        model = session.scalar(select(sql.Model).where(sql.Model.name == name))
        if model is None:
            raise NotFoundError(f"model {name!r} is not in the registry",
                                hint="list models with `quantyard models`")
        return model

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
    def _ensure_source(session: Session, model: sql.Model, ref: SourceRef) -> sql.Source:
        src = session.scalar(select(sql.Source).where(sql.Source.model_id == model.id,
                                                      sql.Source.identity == ref.identity))
        if src is None:
            src = sql.Source(model_id=model.id, kind=ref.kind.value, identity=ref.identity,
                             repo_id=ref.repo_id, revision=ref.revision, commit=ref.commit,
                             path=ref.path, content_hash=ref.content_hash)
            session.add(src)
            session.flush()
        return src

    @staticmethod
    def _ensure_blob(session: Session, sha256: str, size: int) -> None:
        if session.get(sql.Blob, sha256) is None:
            session.add(sql.Blob(sha256=sha256, size=size))
            session.flush()

    def _version(self, session: Session, ref: Ref) -> sql.Version:
        model = self._model(session, ref.model)
        variant = session.scalar(select(sql.Variant).where(sql.Variant.model_id == model.id,
                                                           sql.Variant.name == ref.variant))
        if variant is None:
            raise NotFoundError(f"variant {ref.variant!r} of model {ref.model!r} is not in the registry",
                                hint=f"list variants with `quantyard variants {ref.model}`")
        query = select(sql.Version).where(sql.Version.variant_id == variant.id)
        if ref.version is not None:
            query = query.where(sql.Version.number == ref.version)
        elif ref.alias not in (None, "latest"):
            version = self._resolve_alias(session, variant, ref.alias or "")
            if version is None:
                raise NotFoundError(f"alias {ref.alias!r} is not set on {ref.model}/{ref.variant}")
            return version
        else:
            query = query.order_by(sql.Version.number.desc()).limit(1)
        version = session.scalar(query.options(selectinload(sql.Version.files),
                                               selectinload(sql.Version.results)))
        if version is None:
            raise NotFoundError(f"{ref} does not exist",
                                hint=f"list versions with `quantyard variants {ref.model}`")
        return version

    def _resolve_alias(self, session: Session, variant: sql.Variant, alias: str) -> sql.Version | None:
        del session, variant, alias  # aliases beyond 'latest' arrive with the alias table
        return None

    @staticmethod
    def _view(version: sql.Version, created: bool = False) -> VersionView:
        variant = version.variant
        src = version.source
        return VersionView(
            model=variant.model.name, variant=variant.name, format=variant.format, spec=variant.spec,
            number=version.number, state=version.state, build_key=version.build_key,
            created_at=version.created_at.isoformat(), lineage=version.lineage,
            source={"identity": src.identity, "kind": src.kind, "repo_id": src.repo_id,
                    "revision": src.revision, "commit": src.commit, "content_hash": src.content_hash,
                    "path": src.path},
            files=[FileView(name=f.name, sha256=f.sha256, size=f.size) for f in version.files],
            results=[_result_view(r) for r in version.results],
            created=created,
        )

    # -- writes ----------------------------------------------------------------------------------

    def find_build(self, model: str, variant: str, build_key: str) -> VersionView | None:
        """The newest version of ``model/variant`` built with ``build_key``, if any."""
        with self._read() as session:
            version = session.scalar(
                select(sql.Version).join(sql.Variant).join(sql.Model)
                .where(sql.Model.name == model, sql.Variant.name == variant,
                       sql.Version.build_key == build_key)
                .order_by(sql.Version.number.desc()).limit(1)
            )
            return None if version is None else self._view(version)

    def register_version(self, req: RegisterRequest) -> VersionView:
        """Store the files, then create the next version in one transaction.

        Re-registering the same ``build_key`` returns the existing version (``created=False``)
        unless ``force`` is set. Raises DiskFullError when the blob store is full (nothing is
        registered then).
        """
        validate_model_name(req.model)
        stored = {name: self.blobs.put_file(path) for name, path in sorted(req.files.items())}
        for attempt in range(5):
            try:
                return self._insert_version(req, stored)
            except SAIntegrityError:
                # a concurrent writer created the same model/variant/number first: retry on fresh state
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _insert_version(self, req: RegisterRequest, stored: Mapping[str, Any]) -> VersionView:
        with self._write() as session:
            model = self._ensure_model(session, req.model, req.architecture)
            source = self._ensure_source(session, model, req.source)
            variant = session.scalar(select(sql.Variant).where(sql.Variant.model_id == model.id,
                                                               sql.Variant.name == req.variant))
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
                    return self._view(existing, created=False)
            number = (session.scalar(select(func.max(sql.Version.number))
                                     .where(sql.Version.variant_id == variant.id)) or 0) + 1
            lineage = dict(req.lineage, registered_by=actor())
            version = sql.Version(variant_id=variant.id, number=number, source_id=source.id,
                                  build_key=req.build_key, state=VersionState.CANDIDATE.value,
                                  lineage=lineage)
            session.add(version)
            session.flush()
            for name, blob in stored.items():
                self._ensure_blob(session, blob.sha256, blob.size)
                session.add(sql.VersionFile(version_id=version.id, name=name, sha256=blob.sha256,
                                            size=blob.size))
            session.flush()
            session.refresh(version)
            return self._view(version, created=True)

    def add_result(self, ref: Ref | str, record: Mapping[str, Any]) -> int:
        """Attach an evaluation result to a version; returns its id.

        ``record`` keys: kind, engine, engine_version, window_set_id, status, metrics, hardware,
        error, wall_s.
        """
        ref = Ref.parse(ref) if isinstance(ref, str) else ref
        with self._write() as session:
            version = self._version(session, ref)
            row = sql.Result(version_id=version.id, kind=record["kind"], engine=record["engine"],
                             engine_version=record.get("engine_version"),
                             window_set_id=record.get("window_set_id"), status=record["status"],
                             metrics=dict(record.get("metrics") or {}),
                             hardware=dict(record.get("hardware") or {}),
                             error=record.get("error"), wall_s=record.get("wall_s"))
            session.add(row)
            session.flush()
            return row.id

    def set_state(self, ref: Ref | str, state: VersionState) -> VersionView:
        ref = Ref.parse(ref) if isinstance(ref, str) else ref
        with self._write() as session:
            version = self._version(session, ref)
            current = VersionState(version.state)
            if state not in VERSION_TRANSITIONS[current]:
                allowed = ", ".join(sorted(s.value for s in VERSION_TRANSITIONS[current])) or "none"
                raise IllegalTransitionError(
                    f"{ref} cannot go from {current.value} to {state.value}; allowed from "
                    f"{current.value}: {allowed}")
            version.state = state.value
            session.flush()
            return self._view(version)

    # -- source artifacts ------------------------------------------------------------------------

    def find_source_artifact(self, source: SourceRef, kind: str, key: str) -> ArtifactView | None:
        with self._read() as session:
            row = session.scalar(
                select(sql.SourceArtifact).join(sql.Source)
                .where(sql.Source.identity == source.identity, sql.SourceArtifact.kind == kind,
                       sql.SourceArtifact.key == key).limit(1))
            return None if row is None else _artifact_view(row)

    def put_source_artifact(self, *, model: str, architecture: str | None, source: SourceRef, kind: str,
                            key: str, name: str, path: Path, meta: dict[str, Any]) -> ArtifactView:
        """Register a file belonging to a source (idempotent on (source, kind, key))."""
        blob = self.blobs.put_file(path)
        for attempt in range(5):
            try:
                with self._write() as session:
                    m = self._ensure_model(session, model, architecture)
                    src = self._ensure_source(session, m, source)
                    row = session.scalar(select(sql.SourceArtifact).where(
                        sql.SourceArtifact.source_id == src.id, sql.SourceArtifact.kind == kind,
                        sql.SourceArtifact.key == key))
                    if row is None:
                        self._ensure_blob(session, blob.sha256, blob.size)
                        row = sql.SourceArtifact(source_id=src.id, kind=kind, key=key, name=name,
                                                 sha256=blob.sha256, size=blob.size, meta=meta)
                        session.add(row)
                        session.flush()
                    session.refresh(row)
                    return _artifact_view(row)
            except SAIntegrityError:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def list_source_artifacts(self, source_identity: str, kind: str | None = None) -> list[ArtifactView]:
        """Every artifact of a source (window sets, references, imatrix files...), oldest first."""
        with self._read() as session:
            query = (select(sql.SourceArtifact).join(sql.Source).where(sql.Source.identity == source_identity)
                     .order_by(sql.SourceArtifact.id))
            if kind is not None:
                query = query.where(sql.SourceArtifact.kind == kind)
            return [_artifact_view(r) for r in session.scalars(query).all()]

    def artifact_path(self, artifact: ArtifactView) -> Path:
        """Local path of an artifact's blob (read-only)."""
        path = self.blobs.path_of(artifact.sha256)
        if not path.is_file():
            raise NotFoundError(f"blob of {artifact.kind} {artifact.key} is missing ({artifact.sha256})",
                                hint="run `quantyard registry verify`")
        return path

    # -- reads -----------------------------------------------------------------------------------

    def list_models(self) -> list[ModelView]:
        with self._read() as session:
            rows = session.execute(
                select(sql.Model,
                       select(func.count(sql.Variant.id)).where(sql.Variant.model_id == sql.Model.id)
                       .scalar_subquery(),
                       select(func.count(sql.Version.id)).join(sql.Variant)
                       .where(sql.Variant.model_id == sql.Model.id).scalar_subquery())
                .order_by(sql.Model.name)).all()
            return [ModelView(name=m.name, architecture=m.architecture, variants=nv, versions=nver,
                              created_at=m.created_at.isoformat()) for m, nv, nver in rows]

    def list_variants(self, model: str) -> list[VariantView]:
        with self._read() as session:
            m = self._model(session, model)
            variants = session.scalars(select(sql.Variant).where(sql.Variant.model_id == m.id)
                                       .options(selectinload(sql.Variant.versions))
                                       .order_by(sql.Variant.name)).all()
            return [VariantView(model=model, name=v.name, format=v.format, spec=v.spec,
                                versions=[x.number for x in v.versions],
                                latest=max((x.number for x in v.versions), default=None))
                    for v in variants]

    def get_version(self, ref: Ref | str) -> VersionView:
        ref = Ref.parse(ref) if isinstance(ref, str) else ref
        with self._read() as session:
            return self._view(self._version(session, ref))

    def latest_versions(self, model: str) -> list[VersionView]:
        return [self.get_version(Ref(model=model, variant=v.name)) for v in self.list_variants(model)
                if v.latest is not None]

    def link_files(self, ref: Ref | str, dest: Path) -> list[Path]:
        """Lay out a version's files under ``dest`` as read-only symlinks into the blob store.

        Engines load from there without a copy. Integrity is checked by ``pull`` and ``verify``,
        not here: this is for trusted, local consumers such as evaluators.
        """
        view = self.get_version(ref)
        out = []
        for f in view.files:
            target = _safe_join(dest, f.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            blob = self.blobs.path_of(f.sha256)
            if not blob.is_file():
                raise NotFoundError(f"blob of {view.ref}:{f.name} is missing ({f.sha256})",
                                    hint="run `quantyard registry verify`")
            target.symlink_to(blob)
            out.append(target)
        return out

    def pull(self, ref: Ref | str, dest: Path) -> list[Path]:
        """Copy a version's files into ``dest``, verifying each sha256 while streaming.

        Raises IntegrityError (and leaves no partial file) when a blob does not match.
        """
        view = self.get_version(ref)
        out = []
        for f in view.files:
            target = _safe_join(dest, f.name)
            self.blobs.export(f.sha256, f.size, target)
            out.append(target)
        return out


def _safe_join(dest: Path, name: str) -> Path:
    target = (dest / name).resolve()
    if not target.is_relative_to(dest.resolve()):
        raise RegistryError(f"refusing to write {name!r} outside {dest}")
    return target


def _result_view(r: sql.Result) -> ResultView:
    return ResultView(id=r.id, kind=r.kind, engine=r.engine, engine_version=r.engine_version,
                      window_set_id=r.window_set_id, status=r.status, metrics=r.metrics,
                      hardware=r.hardware, error=r.error, wall_s=r.wall_s,
                      created_at=r.created_at.isoformat())


def _artifact_view(row: sql.SourceArtifact) -> ArtifactView:
    return ArtifactView(source_identity=row.source.identity, kind=row.kind, key=row.key, name=row.name,
                        sha256=row.sha256, size=row.size, meta=row.meta)
