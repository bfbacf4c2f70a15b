"""Listing queries: every variant of a model with its latest version, in a fixed number of queries.

``Registry.latest_versions`` builds a full :class:`VersionView` per variant (one lookup each, with the
lineage documents). A model page with hundreds of variants needs only the totals, so this module reads
them in six set-based queries whatever the number of variants, on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from registry import sql
from registry.views import ModelView, ResultView, VariantSummary


def _latest_ids(model_id: int) -> Any:
    """Subquery: the version ids the ``latest`` aliases of a model point at."""
    return (select(sql.Alias.version_id).join(sql.Variant, sql.Alias.variant_id == sql.Variant.id)
            .where(sql.Variant.model_id == model_id, sql.Alias.name == "latest").scalar_subquery())


def _latest_rows(session: Session, model_id: int) -> list[Any]:
    latest = (select(sql.Alias.variant_id, sql.Alias.version_id).where(sql.Alias.name == "latest")
              .subquery("latest"))
    bpw = sql.Version.lineage[("info", "bpw")].as_float()
    query = (select(sql.Variant.id, sql.Variant.name, sql.Variant.format, sql.Variant.spec, sql.Version.id,
                    sql.Version.number, sql.Version.state, sql.Version.created_at, bpw, sql.Version.source_id)
             .outerjoin(latest, latest.c.variant_id == sql.Variant.id)
             .outerjoin(sql.Version, sql.Version.id == latest.c.version_id)
             .where(sql.Variant.model_id == model_id).order_by(sql.Variant.name))
    return list(session.execute(query).all())


def _sources(session: Session, model_id: int) -> dict[int, dict[str, Any]]:
    s = sql.Source
    return {row.id: {"identity": row.identity, "kind": row.kind, "repo_id": row.repo_id, "revision": row.revision,
                     "commit": row.commit, "content_hash": row.content_hash, "path": row.path}
            for row in session.execute(select(s.id, s.identity, s.kind, s.repo_id, s.revision, s.commit,
                                              s.content_hash, s.path).where(s.model_id == model_id))}


def variant_summaries(session: Session, model: sql.Model, *, format: str | None = None) -> list[VariantSummary]:
    """Every variant of ``model`` (optionally of one format) with its ``latest`` version, by name."""
    ids = _latest_ids(model.id)
    totals = {vid: (int(size or 0), int(n)) for vid, size, n in session.execute(
        select(sql.VersionFile.version_id, func.sum(sql.VersionFile.size), func.count())
        .where(sql.VersionFile.version_id.in_(ids)).group_by(sql.VersionFile.version_id))}
    results: dict[int, list[ResultView]] = {}
    r = sql.Result
    for row in session.execute(select(r.version_id, r.id, r.kind, r.engine, r.engine_version, r.window_set_id,
                                      r.status, r.metrics, r.hardware, r.error, r.wall_s, r.created_at)
                               .where(r.version_id.in_(ids)).order_by(r.id)):
        # Trusted rows of our own schema: build the views without re-validating every field.
        results.setdefault(row.version_id, []).append(ResultView.model_construct(
            id=row.id, kind=row.kind, engine=row.engine, engine_version=row.engine_version,
            window_set_id=row.window_set_id, status=row.status, metrics=row.metrics or {}, hardware=row.hardware or {},
            error=row.error, wall_s=row.wall_s, created_at=row.created_at.isoformat()))
    aliases: dict[int, dict[str, int]] = {}
    for variant_id, name, number in session.execute(
            select(sql.Alias.variant_id, sql.Alias.name, sql.Version.number)
            .join(sql.Version, sql.Alias.version_id == sql.Version.id)
            .join(sql.Variant, sql.Alias.variant_id == sql.Variant.id)
            .where(sql.Variant.model_id == model.id).order_by(sql.Alias.name)):
        aliases.setdefault(variant_id, {})[name] = number
    counts = dict(session.execute(select(sql.Version.variant_id, func.count())
                                  .join(sql.Variant, sql.Version.variant_id == sql.Variant.id)
                                  .where(sql.Variant.model_id == model.id).group_by(sql.Version.variant_id)).all())
    sources = _sources(session, model.id)
    out = []
    for vid, name, fmt, spec, version_id, number, state, created, bpw, source_id in _latest_rows(session, model.id):
        if format is not None and fmt != format:
            continue
        size, n_files = totals.get(version_id, (0, 0))
        out.append(VariantSummary.model_construct(
            model=model.name, variant=name, format=fmt, spec=spec, version=number, versions=counts.get(vid, 0),
            state=state, created_at=created.isoformat() if created else None, aliases=aliases.get(vid, {}),
            size=size, files=n_files, bpw=bpw, source=dict(sources.get(source_id, {})),
            results=results.get(version_id, [])))
    return out


def model_views(session: Session, *, architecture: str | None = None, format: str | None = None,
                query: str | None = None) -> list[ModelView]:
    """Models by name with their variant and version counts and formats, in three aggregate queries.

    ``query`` keeps models whose name contains it (case-insensitive)."""
    stmt = select(sql.Model).order_by(sql.Model.name)
    if architecture is not None:
        stmt = stmt.where(sql.Model.architecture == architecture)
    if format is not None:
        stmt = stmt.where(sql.Model.variants.any(sql.Variant.format == format))
    if query:
        pattern = "%" + query.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        stmt = stmt.where(func.lower(sql.Model.name).like(pattern, escape="\\"))
    models = list(session.scalars(stmt))
    only = [sql.Variant.model_id.in_([m.id for m in models])] if architecture or format or query else []
    formats: dict[int, dict[str, int]] = {}
    for model_id, fmt, n in session.execute(select(sql.Variant.model_id, sql.Variant.format, func.count())
                                            .where(*only).group_by(sql.Variant.model_id, sql.Variant.format)):
        formats.setdefault(model_id, {})[fmt] = n
    versions = dict(session.execute(select(sql.Variant.model_id, func.count(sql.Version.id))
                                    .join(sql.Version, sql.Version.variant_id == sql.Variant.id)
                                    .where(*only).group_by(sql.Variant.model_id)).all())
    return [ModelView(name=m.name, architecture=m.architecture, variants=sum(formats.get(m.id, {}).values()),
                      versions=versions.get(m.id, 0), created_at=m.created_at.isoformat(),
                      formats=sorted(formats.get(m.id, {}))) for m in models]


def generation(session: Session) -> str:
    """A stamp that moves with every write made through the Registry API: registrations, alias moves and
    state changes (each appends to the audit log), results, source artifacts, new models — the newest id
    of each table (an index lookup on both backends).

    On SQLite writers are serialized, so the stamp moves on every commit. PostgreSQL may commit sequence
    values out of order (a transaction holding id 10 commits after one holding 11): a cache keyed on this
    stamp must also expire its entries after a short time."""
    stamps = [select(func.max(t.id)).scalar_subquery() for t in (sql.AuditEvent, sql.Result, sql.SourceArtifact,
                                                                  sql.Model)]
    return "-".join(str(x or 0) for x in session.execute(select(*stamps)).one())
