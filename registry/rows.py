"""SQL rows to API views, and the lineage edges a new version records."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from pipeline.errors import RegistryError
from registry import sql
from registry.views import ArtifactView, FileView, InputView, RegisterRequest, ResultView, VersionView


def tool_ref(tool: Mapping[str, Any]) -> str:
    """Lineage reference of a tool: ``name@key=value,...`` with every version it recorded."""
    rest = ",".join(f"{k}={tool[k]}" for k in sorted(tool) if k != "name")
    return f"{tool.get('name', 'unknown')}@{rest}"[:400]


def derive_inputs(req: RegisterRequest) -> list[InputView]:
    """Every lineage edge of a new version: its source, its tool, and the inputs it declared."""
    edges = [InputView(kind="source", ref=req.source.identity)]
    tool = req.lineage.get("tool")
    if isinstance(tool, dict) and tool:
        edges.append(InputView(kind="tool", ref=tool_ref(tool), name=tool.get("name"), meta=tool))
    for item in [*req.inputs, *(req.lineage.get("inputs") or [])]:
        edge = item if isinstance(item, InputView) else InputView.model_validate(item)
        edges.append(edge)
    first: dict[tuple[str, str], InputView] = {}
    for e in edges:
        first.setdefault((e.kind, e.ref), e)  # the first edge of each (kind, ref), in order
    return list(first.values())


def version_view(session: Session, version: sql.Version, created: bool = False) -> VersionView:
    variant = version.variant
    src = version.source
    aliases = session.scalars(select(sql.Alias.name).where(sql.Alias.version_id == version.id)
                              .order_by(sql.Alias.name)).all()
    return VersionView(
        model=variant.model.name, variant=variant.name, format=variant.format, spec=variant.spec,
        number=version.number, state=version.state, build_key=version.build_key,
        created_at=version.created_at.isoformat(), lineage=version.lineage,
        source={"identity": src.identity, "kind": src.kind, "repo_id": src.repo_id, "revision": src.revision,
                "commit": src.commit, "content_hash": src.content_hash, "path": src.path},
        files=[FileView(name=f.name, sha256=f.sha256, size=f.size) for f in version.files],
        results=[result_view(r) for r in version.results], aliases=list(aliases),
        inputs=[InputView(kind=i.kind, ref=i.ref, name=i.name, sha256=i.sha256, meta=i.meta)
                for i in version.inputs],
        architecture=variant.model.architecture, created=created)


def version_loads() -> list[Any]:
    return [selectinload(sql.Version.files), selectinload(sql.Version.results), selectinload(sql.Version.inputs)]


def safe_join(dest: Path, name: str) -> Path:
    target = (dest / name).resolve()
    if not target.is_relative_to(dest.resolve()):
        raise RegistryError(f"refusing to write {name!r} outside {dest}")
    return target


def result_view(r: sql.Result) -> ResultView:
    return ResultView(id=r.id, kind=r.kind, engine=r.engine, engine_version=r.engine_version,
                      window_set_id=r.window_set_id, status=r.status, metrics=r.metrics, hardware=r.hardware,
                      error=r.error, wall_s=r.wall_s, created_at=r.created_at.isoformat())


def artifact_view(row: sql.SourceArtifact) -> ArtifactView:
    return ArtifactView(source_identity=row.source.identity, kind=row.kind, key=row.key, name=row.name,
                        sha256=row.sha256, size=row.size, meta=row.meta)
