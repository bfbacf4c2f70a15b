"""Alembic environment. Quantyard runs migrations programmatically (registry.store.upgrade),
passing an open connection in ``config.attributes['connection']``."""

from __future__ import annotations

from alembic import context

from registry.sql import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        from sqlalchemy import create_engine

        url = config.get_main_option("sqlalchemy.url")
        assert url is not None, "alembic: neither a connection nor sqlalchemy.url was given"
        engine = create_engine(url)
        with engine.begin() as conn:
            _run(conn)
        return
    _run(connection)


def _run(connection) -> None:  # noqa: ANN001 - alembic hands us a Connection
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations_online()
