"""Registry entry point: :func:`open_registry` picks the backends from the location.

Metadata location (``QUANTYARD_REGISTRY`` / ``--registry``):

- a folder path ``/srv/quantyard`` → SQLite ``registry.db`` inside it;
- ``sqlite:///path/registry.db`` → that SQLite database;
- ``postgresql://user:pass@host:5432/db`` (driver psycopg 3) → a shared PostgreSQL database.

Blob store URL (``QUANTYARD_BLOBS`` / ``--blobs``), first match wins:

1. the URL given explicitly (a folder, ``file:///…``, or any fsspec URL such as ``s3://bucket/prefix``,
   with storage options from ``QUANTYARD_BLOBS_OPTIONS``);
2. the URL recorded in the database (``registry_settings.blobs_url``): the first client that opens a
   registry with an explicit URL records it, so every later client of a shared registry finds it;
3. ``blobs/`` beside the SQLite database. A PostgreSQL registry has no such default and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import Session

from pipeline.config import Settings
from pipeline.errors import RegistryError, RegistryPathError
from registry import sql
from registry.blobs import BlobStore, LocalBlobStore
from registry.store import Registry

MIGRATIONS = Path(__file__).parent / "migrations"
DB_NAME = "registry.db"
BLOBS_URL_KEY = "blobs_url"

__all__ = ["Registry", "blob_store", "close_engines", "current_revision", "head_revision", "open_registry", "upgrade",
           "upgrade_registry"]

_PG_ENGINES: dict[str, Engine] = {}


def _alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    script = ScriptDirectory(str(MIGRATIONS))
    head = script.get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except OperationalError as exc:
        raise RegistryError(f"cannot connect to the registry database {engine.url.render_as_string()}: "
                            f"{str(exc.orig).strip().splitlines()[0] if exc.orig else exc}",
                            hint="check the URI, that the server runs and that the user may connect") from exc


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the Alembic migrations up to ``revision`` in one transaction."""
    from alembic import command

    cfg = _alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def _sqlite_engine(db: Path) -> Engine:
    engine = create_engine(f"sqlite:///{db}", connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's begin event issue BEGIN itself so writes can take the lock up front.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get("quantyard_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _postgres_engine(location: str) -> Engine:
    try:
        url = make_url(location)
    except ArgumentError as exc:
        raise RegistryError(f"invalid PostgreSQL URI {location!r}: {exc}") from exc
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    key = url.render_as_string(hide_password=False)
    if key not in _PG_ENGINES:  # one pool per database per process
        _PG_ENGINES[key] = create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4)
    return _PG_ENGINES[key]


def close_engines() -> None:
    """Close every pooled PostgreSQL connection this process holds (tests, long-lived servers on reload)."""
    while _PG_ENGINES:
        _PG_ENGINES.popitem()[1].dispose()


def _resolve(location: str) -> tuple[Engine, Path | None, Path | None]:
    """The metadata engine and, for SQLite, the folder that holds the database and the database file."""
    if location.startswith(("postgresql:", "postgresql+", "postgres:")):
        return _postgres_engine(location), None, None
    if location.startswith("sqlite:///"):
        db = Path(location.removeprefix("sqlite:///")).expanduser()
        root = db.parent
    elif "://" in location:
        raise RegistryError(f"unsupported registry URI {location!r}: expected a folder path, sqlite:///PATH or "
                            "postgresql://USER@HOST/DB")
    else:
        root = Path(location).expanduser()
        db = root / DB_NAME
    if root.exists() and not root.is_dir():
        raise RegistryPathError(
            f"registry location {root} is a file, expected a folder (or a missing path to create)",
            hint="point --registry / QUANTYARD_REGISTRY at a folder, e.g. ~/.local/share/quantyard/registry")
    if db.exists() and not db.is_file():
        raise RegistryPathError(f"registry database {db} is not a file")
    return _sqlite_engine(db), root, db


def blob_store(url: str, options: dict[str, Any] | None = None) -> BlobStore:
    """The blob store for ``url``: a local folder (or ``file://``), else an fsspec filesystem."""
    if "://" not in url or url.startswith("file://"):
        return LocalBlobStore(Path(url.removeprefix("file://")).expanduser())
    from registry.remote import FsspecBlobStore

    return FsspecBlobStore(url, options)


def _read_setting(engine: Engine, key: str) -> str | None:
    with Session(engine) as session:
        return session.scalar(select(sql.RegistrySetting.value).where(sql.RegistrySetting.key == key))


def _record_setting(engine: Engine, key: str, value: str) -> None:
    with Session(engine.execution_options(quantyard_write=True)) as session, session.begin():
        if session.get(sql.RegistrySetting, key) is None:
            session.add(sql.RegistrySetting(key=key, value=value))


def _choose_blobs(engine: Engine, root: Path | None, explicit: str | None, location: str) -> str:
    if explicit is not None and "://" not in explicit:
        explicit = str(Path(explicit).expanduser().resolve())  # record folders absolutely
    recorded = _read_setting(engine, BLOBS_URL_KEY)
    if explicit is not None and recorded is None:
        _record_setting(engine, BLOBS_URL_KEY, explicit)
    url = explicit or recorded or (str(root / "blobs") if root is not None else None)
    if url is None:
        raise RegistryError(f"the registry at {make_url(location).render_as_string()} has no blob store URL",
                            hint="set QUANTYARD_BLOBS (or --blobs) to a folder or s3://bucket/prefix once; "
                                 "it is then recorded in the registry for every client")
    return url


def _location_parts(location: str | Settings, blobs: str | None,
                    blobs_options: dict[str, Any] | None) -> tuple[str, str | None, dict[str, Any], Path | None]:
    if isinstance(location, Settings):
        return (location.registry, blobs or location.blobs, blobs_options or location.blobs_options,
                location.cache_dir / "blob-cache")
    return location, blobs, blobs_options or {}, None


def open_registry(location: str | Settings, *, blobs: str | None = None, blobs_options: dict[str, Any] | None = None,
                  create: bool = True) -> Registry:
    """Open (and, for a new location, create) a registry.

    ``location`` is a folder, ``sqlite:///…`` or ``postgresql://…`` URI, or a :class:`Settings`
    (then ``registry``, ``blobs``, ``blobs_options`` and ``cache_dir`` come from it).

    Raises:
        RegistryPathError: the location is a file or otherwise unusable.
        RegistryError: the database is unreachable, or its schema is older than this Quantyard
            (run ``quantyard registry upgrade``).
    """
    location, blobs, options, cache = _location_parts(location, blobs, blobs_options)
    engine, root, db = _resolve(location)
    if root is not None:
        if not create and db is not None and not db.exists():
            raise RegistryPathError(f"no registry at {location}", hint="run `quantyard convert` to create one")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise RegistryPathError(f"cannot create registry folder {root}: a path component is a file") from exc
    rev = current_revision(engine)
    if rev is None and create:
        upgrade(engine)
    elif rev != head_revision():
        raise RegistryError(
            f"registry schema at {location} is at revision {rev or 'none (empty database)'}, this Quantyard "
            f"expects {head_revision()}",
            hint="back it up, then run `quantyard registry upgrade`")
    url = _choose_blobs(engine, root, blobs, location)
    return Registry(engine, blob_store(url, options), location, cache_dir=cache)


def upgrade_registry(location: str | Settings) -> tuple[str | None, str]:
    """Migrate the registry's schema to head (creating it if empty); returns (from, to) revisions."""
    location, _, _, _ = _location_parts(location, None, None)
    engine, root, _ = _resolve(location)
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    before = current_revision(engine)
    upgrade(engine)
    return before, head_revision()
