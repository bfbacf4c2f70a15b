"""Registry fixtures: every backend-parametrized test runs on SQLite and on a real PostgreSQL server;
object-storage tests run against moto's standalone S3 server. Both servers are started here, on
loopback, once per session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from registry import Registry, close_engines, open_registry, upgrade
from tests.registry.servers import PostgresServer, S3Server, pg_bindir, postgres_server, s3_server


@dataclass
class Backend:
    """A registry location of one kind, private to one test."""

    kind: str  # sqlite | postgres
    location: str
    blobs: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def open(self, **kw: Any) -> Registry:
        return open_registry(self.location, blobs=self.blobs, blobs_options=self.options or None, **kw)

    @property
    def cli(self) -> list[str]:
        return ["--registry", self.location]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run every registry backend)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    if pg_bindir() is None:
        _unavailable("PostgreSQL server binaries are not installed: run `make setup`")
    with postgres_server() as server:
        yield server
    close_engines()


@pytest.fixture(scope="session")
def pg_template(pg_server: PostgresServer) -> str:
    """A database migrated to head once; each test gets a copy (CREATE DATABASE ... TEMPLATE)."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    name = pg_server.new_database()
    engine = create_engine(pg_server.url(name, "postgresql+psycopg"), poolclass=NullPool)
    upgrade(engine)
    engine.dispose()
    return name


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path, registry_template: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        dest = tmp_path / "registry"
        shutil.copytree(registry_template, dest)
        yield Backend("sqlite", str(dest))
        return
    server: PostgresServer = request.getfixturevalue("pg_server")
    db = server.new_database(template=request.getfixturevalue("pg_template"))
    b = Backend("postgres", server.url(db), blobs=str(tmp_path / "blobs"))
    b.open()  # records the blob URL in the database, as a first client would
    b.blobs = None  # later clients find it there
    yield b
    close_engines()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server
