"""SQLAlchemy 2 tables of the registry. Alembic (``registry/migrations``) owns the schema;
these classes only mirror it for queries. One model serves SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


class Model(Base):
    __tablename__ = "models"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    architecture: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    variants: Mapped[list[Variant]] = relationship(back_populates="model", order_by="Variant.name")
    sources: Mapped[list[Source]] = relationship(back_populates="model")


class Source(Base):
    __tablename__ = "sources"
    __table_args__ = (UniqueConstraint("model_id", "identity", name="uq_source_identity"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    kind: Mapped[str] = mapped_column(String(16))
    identity: Mapped[str] = mapped_column(String(400))
    repo_id: Mapped[str | None] = mapped_column(String(300))
    revision: Mapped[str | None] = mapped_column(String(300))
    commit: Mapped[str | None] = mapped_column(String(64))
    path: Mapped[str | None] = mapped_column(Text)
    content_hash: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    model: Mapped[Model] = relationship(back_populates="sources")
    artifacts: Mapped[list[SourceArtifact]] = relationship(back_populates="source")


class SourceArtifact(Base):
    """Files that belong to a source rather than a variant: window sets, reference logits,
    imatrix files, EXL2 measurements. Keyed so every later run can find and reuse them."""

    __tablename__ = "source_artifacts"
    __table_args__ = (UniqueConstraint("source_id", "kind", "key", name="uq_source_artifact"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id"))
    kind: Mapped[str] = mapped_column(String(40))
    key: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(300))
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))
    size: Mapped[int] = mapped_column(BigInteger)
    meta: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    source: Mapped[Source] = relationship(back_populates="artifacts")


class Variant(Base):
    __tablename__ = "variants"
    __table_args__ = (UniqueConstraint("model_id", "name", name="uq_variant_name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    name: Mapped[str] = mapped_column(String(200))
    format: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    model: Mapped[Model] = relationship(back_populates="variants")
    versions: Mapped[list[Version]] = relationship(back_populates="variant", order_by="Version.number")


class Version(Base):
    __tablename__ = "versions"
    __table_args__ = (UniqueConstraint("variant_id", "number", name="uq_version_number"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    variant_id: Mapped[int] = mapped_column(ForeignKey("variants.id"))
    number: Mapped[int] = mapped_column(Integer)
    source_id: Mapped[int] = mapped_column(ForeignKey("sources.id"))
    build_key: Mapped[str] = mapped_column(String(64), index=True)
    state: Mapped[str] = mapped_column(String(16))
    lineage: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    variant: Mapped[Variant] = relationship(back_populates="versions")
    source: Mapped[Source] = relationship()
    files: Mapped[list[VersionFile]] = relationship(back_populates="version", order_by="VersionFile.name")
    results: Mapped[list[Result]] = relationship(back_populates="version", order_by="Result.id")
    inputs: Mapped[list[VersionInput]] = relationship(back_populates="version", order_by="VersionInput.id")


class Blob(Base):
    __tablename__ = "blobs"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class VersionFile(Base):
    __tablename__ = "version_files"
    __table_args__ = (UniqueConstraint("version_id", "name", name="uq_version_file"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    name: Mapped[str] = mapped_column(String(500))
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))
    size: Mapped[int] = mapped_column(BigInteger)
    version: Mapped[Version] = relationship(back_populates="files")


class Result(Base):
    """One evaluation of a version on one engine: quality metrics on a window set, or speed."""

    __tablename__ = "results"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    kind: Mapped[str] = mapped_column(String(16))
    engine: Mapped[str] = mapped_column(String(40))
    engine_version: Mapped[str | None] = mapped_column(String(200))
    window_set_id: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    hardware: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    wall_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    version: Mapped[Version] = relationship(back_populates="results")


class Alias(Base):
    """A movable name on one version of a variant (``latest``, ``production``...)."""

    __tablename__ = "aliases"
    __table_args__ = (UniqueConstraint("variant_id", "name", name="uq_alias_name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    variant_id: Mapped[int] = mapped_column(ForeignKey("variants.id"))
    name: Mapped[str] = mapped_column(String(100))
    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(200))
    version: Mapped[Version] = relationship()


class AuditEvent(Base):
    """Append-only log of every alias move and state change: who, when, what, from, to."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_variant", "variant_id", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(40))
    variant_id: Mapped[int] = mapped_column(ForeignKey("variants.id"))
    version_id: Mapped[int | None] = mapped_column(ForeignKey("versions.id"))
    name: Mapped[str | None] = mapped_column(String(100))
    old: Mapped[str | None] = mapped_column(String(100))
    new: Mapped[str | None] = mapped_column(String(100))
    note: Mapped[str | None] = mapped_column(Text)
    variant: Mapped[Variant] = relationship()


class VersionInput(Base):
    """One lineage edge: something a version was built from (its source, the tool, calibration data,
    an imatrix, a base file). Indexed by (kind, ref) so the reverse question, "what was built from
    this?", is one query."""

    __tablename__ = "version_inputs"
    __table_args__ = (UniqueConstraint("version_id", "kind", "ref", name="uq_version_input"),
                      Index("ix_version_inputs_ref", "kind", "ref"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"))
    kind: Mapped[str] = mapped_column(String(40))
    ref: Mapped[str] = mapped_column(String(400))
    name: Mapped[str | None] = mapped_column(String(300))
    sha256: Mapped[str | None] = mapped_column(String(64))
    meta: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    version: Mapped[Version] = relationship(back_populates="inputs")


class RegistrySetting(Base):
    """Registry-wide settings stored with the metadata, e.g. the blob store URL shared by every client."""

    __tablename__ = "registry_settings"
    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
