"""What the registry API returns: plain pydantic views, detached from the database session.

The CLI, the web listing and ``quantyard validate`` all read these; none of them see SQL rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline.specs import SourceRef

#: Alias names the registry maintains itself; users cannot set or delete them.
AUTOMATIC_ALIASES = frozenset({"latest"})


class FileView(BaseModel):
    name: str
    sha256: str
    size: int


class ResultView(BaseModel):
    id: int
    kind: str  # quality | speed | serving (pipeline.results.EvalResult)
    engine: str
    engine_version: str | None
    window_set_id: str | None
    status: str  # ok | failed
    metrics: dict[str, Any]
    hardware: dict[str, Any]
    error: str | None
    wall_s: float | None
    created_at: str


class InputView(BaseModel):
    """One lineage edge of a version: kind (source, tool, calibration, imatrix, base...) and a reference."""

    kind: str
    ref: str
    name: str | None = None
    sha256: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


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
    aliases: list[str] = Field(default_factory=list)
    inputs: list[InputView] = Field(default_factory=list)
    architecture: str | None = None
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
    latest_state: str | None = None
    aliases: dict[str, int] = Field(default_factory=dict)  # alias -> version number


class ModelView(BaseModel):
    name: str
    architecture: str | None
    variants: int
    versions: int
    created_at: str
    formats: list[str] = Field(default_factory=list)


class ArtifactView(BaseModel):
    source_identity: str
    kind: str
    key: str
    name: str
    sha256: str
    size: int
    meta: dict[str, Any]


class AuditView(BaseModel):
    """One audit-log entry: an alias move (``alias.set`` / ``alias.delete``) or a state change (``state``)."""

    id: int
    at: str
    actor: str
    action: str
    model: str
    variant: str
    version: int | None
    name: str | None  # the alias, for alias events
    old: str | None  # previous version number (alias) or state
    new: str | None
    note: str | None


class LineageView(BaseModel):
    """Lineage of one version, upstream: where its bytes came from."""

    ref: str
    source: dict[str, Any]
    inputs: list[InputView]
    tool: dict[str, Any]
    parameters: dict[str, Any]
    environment: dict[str, Any]
    build_key: str


class RegisterRequest(BaseModel):
    """Everything needed to register one immutable version of a variant.

    ``inputs`` are extra lineage edges (calibration data, imatrix, base file...); each also lands in
    ``lineage["inputs"]``. The source and the tool (``lineage["tool"]``) are recorded automatically.
    """

    model: str
    architecture: str | None = None
    source: SourceRef
    variant: str
    format: str
    spec: dict[str, Any]
    build_key: str
    lineage: dict[str, Any]
    files: dict[str, Path]  # logical name -> path on disk
    inputs: list[InputView] = Field(default_factory=list)
    force: bool = False


class VariantSummary(BaseModel):
    """One variant of a model with its ``latest`` version, in the shape a listing needs: no lineage
    documents or file lists, just their totals (see :meth:`registry.store.Registry.variant_summaries`)."""

    model: str
    variant: str
    format: str
    spec: dict[str, Any]
    version: int | None  # the number ``latest`` points at; None for a variant with no version yet
    versions: int
    state: str | None
    created_at: str | None
    aliases: dict[str, int] = Field(default_factory=dict)  # every alias of the variant -> version number
    size: int = 0
    files: int = 0
    bpw: float | None = None  # lineage["info"]["bpw"] when the converter recorded it
    source: dict[str, Any] = Field(default_factory=dict)
    results: list[ResultView] = Field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"{self.model}/{self.variant}@{self.version}" if self.version is not None else \
            f"{self.model}/{self.variant}"
