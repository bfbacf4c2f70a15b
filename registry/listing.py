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
from registry.rows import result_view
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
                    sql.Version.number, sql.Version.state, sql.Version.created_at, bpw, sql.Source)
             .outerjoin(latest, latest.c.variant_id == sql.Variant.id)
             .outerjoin(sql.Version, sql.Version.id == latest.c.version_id)
             .outerjoin(sql.Source, sql.Source.id == sql.Version.source_id)
             .where(sql.Variant.model_id == model_id).order_by(sql.Variant.name))
    return list(session.execute(query).all())


def _source_dict(src: sql.Source | None) -> dict[str, Any]:
    if src is None:
        return {}
    return {"identity": src.identity, "kind": src.kind, "repo_id": src.repo_id, "revision": src.revision,
            "commit": src.commit, "content_hash": src.content_hash, "path": src.path}


def variant_summaries(session: Session, model: sql.Model, *, format: str | None = None) -> list[VariantSummary]:
    """Every variant of ``model`` (optionally of one format) with its ``latest`` version, by name."""
    ids = _latest_ids(model.id)
    totals = {vid: (int(size or 0), int(n)) for vid, size, n in session.execute(
        select(sql.VersionFile.version_id, func.sum(sql.VersionFile.size), func.count())
        .where(sql.VersionFile.version_id.in_(ids)).group_by(sql.VersionFile.version_id))}
    results: dict[int, list[ResultView]] = {}
    for r in session.scalars(select(sql.Result).where(sql.Result.version_id.in_(ids)).order_by(sql.Result.id)):
        results.setdefault(r.version_id, []).append(result_view(r))
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
    out = []
    for vid, name, fmt, spec, version_id, number, state, created, bpw, src in _latest_rows(session, model.id):
        if format is not None and fmt != format:
            continue
        size, n_files = totals.get(version_id, (0, 0))
        out.append(VariantSummary(
            model=model.name, variant=name, format=fmt, spec=spec, version=number, versions=counts.get(vid, 0),
            state=state, created_at=created.isoformat() if created else None, aliases=aliases.get(vid, {}),
            size=size, files=n_files, bpw=bpw, source=_source_dict(src), results=results.get(version_id, [])))
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
    formats: dict[int, dict[str, int]] = {}
    for model_id, fmt, n in session.execute(select(sql.Variant.model_id, sql.Variant.format, func.count())
                                            .group_by(sql.Variant.model_id, sql.Variant.format)):
        formats.setdefault(model_id, {})[fmt] = n
    versions = dict(session.execute(select(sql.Variant.model_id, func.count(sql.Version.id))
                                    .join(sql.Version, sql.Version.variant_id == sql.Variant.id)
                                    .group_by(sql.Variant.model_id)).all())
    return [ModelView(name=m.name, architecture=m.architecture, variants=sum(formats.get(m.id, {}).values()),
                      versions=versions.get(m.id, 0), created_at=m.created_at.isoformat(),
                      formats=sorted(formats.get(m.id, {}))) for m in models]
