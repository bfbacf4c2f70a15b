"""aliases with an audit log, queryable lineage edges, registry settings

Adds ``aliases``, ``audit_log``, ``version_inputs`` and ``registry_settings``, plus indexes that
reverse lineage and integrity checks need. Existing data is carried over: every variant gets its
``latest`` alias (an audit event says the migration set it), and every version gets its ``source``
and ``tool`` lineage edges, plus any ``lineage["inputs"]`` it recorded.

Revision ID: 0002_aliases_audit_lineage
Revises: 0001_initial
Create Date: 2026-12-01
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0002_aliases_audit_lineage"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
MIGRATION_ACTOR = "migration:0002"


def upgrade() -> None:
    _create_tables()
    op.create_index("ix_versions_source", "versions", ["source_id"])
    op.create_index("ix_version_files_sha256", "version_files", ["sha256"])
    op.create_index("ix_source_artifacts_sha256", "source_artifacts", ["sha256"])
    _backfill(op.get_bind())


def _create_tables() -> None:
    op.create_table(
        "aliases",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("variant_id", sa.Integer, sa.ForeignKey("variants.id"), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=False),
        sa.UniqueConstraint("variant_id", "name", name="uq_alias_name"),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(40), nullable=False),
        sa.Column("variant_id", sa.Integer, sa.ForeignKey("variants.id"), nullable=False),
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id")),
        sa.Column("name", sa.String(100)),
        sa.Column("old", sa.String(100)),
        sa.Column("new", sa.String(100)),
        sa.Column("note", sa.Text),
    )
    op.create_index("ix_audit_variant", "audit_log", ["variant_id", "id"])
    op.create_table(
        "version_inputs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("ref", sa.String(400), nullable=False),
        sa.Column("name", sa.String(300)),
        sa.Column("sha256", sa.String(64)),
        sa.Column("meta", sa.JSON, nullable=False),
        sa.UniqueConstraint("version_id", "kind", "ref", name="uq_version_input"),
    )
    op.create_index("ix_version_inputs_ref", "version_inputs", ["kind", "ref"])
    op.create_table(
        "registry_settings",
        sa.Column("key", sa.String(100), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )


def _tool_ref(tool: dict[str, Any]) -> str:
    rest = ",".join(f"{k}={tool[k]}" for k in sorted(tool) if k != "name")
    return f"{tool.get('name', 'unknown')}@{rest}"[:400]


def _edges(lineage: dict[str, Any], source_identity: str) -> list[dict[str, Any]]:
    """The lineage edges of one version, frozen here as this revision defines them."""
    edges: list[dict[str, Any]] = [{"kind": "source", "ref": source_identity, "name": None, "sha256": None,
                                    "meta": {}}]
    tool = lineage.get("tool")
    if isinstance(tool, dict) and tool:
        edges.append({"kind": "tool", "ref": _tool_ref(tool), "name": tool.get("name"), "sha256": None,
                      "meta": tool})
    for item in lineage.get("inputs") or []:
        if isinstance(item, dict) and item.get("kind") and (item.get("ref") or item.get("sha256")):
            edges.append({"kind": str(item["kind"]), "ref": str(item.get("ref") or f"sha256:{item['sha256']}"),
                          "name": item.get("name"), "sha256": item.get("sha256"), "meta": item.get("meta") or {}})
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for e in edges:
        first.setdefault((e["kind"], e["ref"]), e)  # the first edge of each (kind, ref), in order
    return list(first.values())


def _backfill(bind: sa.Connection) -> None:
    meta = sa.MetaData()
    versions = sa.Table("versions", meta, autoload_with=bind)
    sources = sa.Table("sources", meta, autoload_with=bind)
    aliases = sa.Table("aliases", meta, autoload_with=bind)
    audit = sa.Table("audit_log", meta, autoload_with=bind)
    inputs = sa.Table("version_inputs", meta, autoload_with=bind)
    now = datetime.now(UTC)
    rows = bind.execute(sa.select(versions.c.id, versions.c.variant_id, versions.c.number, versions.c.lineage,
                                  sources.c.identity).join(sources, versions.c.source_id == sources.c.id)
                        .order_by(versions.c.id)).all()
    latest: dict[int, tuple[int, int]] = {}
    for vid, variant_id, number, lineage, identity in rows:
        if variant_id not in latest or number > latest[variant_id][1]:
            latest[variant_id] = (vid, number)
        data = json.loads(lineage) if isinstance(lineage, str) else (lineage or {})
        for edge in _edges(data, identity):
            bind.execute(inputs.insert().values(version_id=vid, **edge))
    for variant_id, (vid, number) in sorted(latest.items()):
        bind.execute(aliases.insert().values(variant_id=variant_id, name="latest", version_id=vid,
                                             updated_at=now, updated_by=MIGRATION_ACTOR))
        bind.execute(audit.insert().values(created_at=now, actor=MIGRATION_ACTOR, action="alias.set",
                                           variant_id=variant_id, version_id=vid, name="latest", old=None,
                                           new=str(number), note="backfilled by migration 0002"))


def downgrade() -> None:
    for index, table in (("ix_versions_source", "versions"), ("ix_version_files_sha256", "version_files"),
                         ("ix_source_artifacts_sha256", "source_artifacts")):
        op.drop_index(index, table_name=table)
    for table in ("registry_settings", "version_inputs", "audit_log", "aliases"):
        op.drop_table(table)
