"""initial registry schema: models, sources, variants, versions, files, blobs, results

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("architecture", sa.String(200)),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "sources",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("model_id", sa.Integer, sa.ForeignKey("models.id"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("identity", sa.String(400), nullable=False),
        sa.Column("repo_id", sa.String(300)),
        sa.Column("revision", sa.String(300)),
        sa.Column("commit", sa.String(64)),
        sa.Column("path", sa.Text),
        sa.Column("content_hash", sa.String(64)),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("model_id", "identity", name="uq_source_identity"),
    )
    op.create_table(
        "source_artifacts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("source_id", sa.Integer, sa.ForeignKey("sources.id"), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("name", sa.String(300), nullable=False),
        sa.Column("sha256", sa.String(64), sa.ForeignKey("blobs.sha256"), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("meta", sa.JSON, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("source_id", "kind", "key", name="uq_source_artifact"),
    )
    op.create_table(
        "variants",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("model_id", sa.Integer, sa.ForeignKey("models.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("model_id", "name", name="uq_variant_name"),
    )
    op.create_table(
        "versions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("variant_id", sa.Integer, sa.ForeignKey("variants.id"), nullable=False),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("source_id", sa.Integer, sa.ForeignKey("sources.id"), nullable=False),
        sa.Column("build_key", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("lineage", sa.JSON, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("variant_id", "number", name="uq_version_number"),
    )
    op.create_index("ix_versions_build_key", "versions", ["build_key"])
    op.create_table(
        "version_files",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("name", sa.String(500), nullable=False),
        sa.Column("sha256", sa.String(64), sa.ForeignKey("blobs.sha256"), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.UniqueConstraint("version_id", "name", name="uq_version_file"),
    )
    op.create_table(
        "results",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("version_id", sa.Integer, sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("engine", sa.String(40), nullable=False),
        sa.Column("engine_version", sa.String(200)),
        sa.Column("window_set_id", sa.String(64)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("hardware", sa.JSON, nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("wall_s", sa.Float),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("ix_results_version", "results", ["version_id"])


def downgrade() -> None:
    for table in ("results", "version_files", "versions", "variants", "source_artifacts", "sources",
                  "blobs", "models"):
        op.drop_table(table)
