"""Registry entry point: :func:`open_registry` picks the backend from the location.

Locations:
- a folder path ``/srv/quantyard`` → SQLite ``registry.db`` plus ``blobs/`` inside it;
- ``sqlite:///path/registry.db`` → that database, blobs beside it in ``blobs/``.
"""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event

from pipeline.errors import RegistryError, RegistryPathError
from registry.blobs import LocalBlobStore
from registry.store import Registry

MIGRATIONS = Path(__file__).parent / "migrations"
DB_NAME = "registry.db"

__all__ = ["Registry", "head_revision", "open_registry", "upgrade"]


def _alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False))
    return cfg


def head_revision() -> str:
    script = ScriptDirectory(str(MIGRATIONS))
    head = script.get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the Alembic migrations up to ``revision`` (transactional)."""
    from alembic import command

    cfg = _alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def _sqlite_engine(db: Path) -> Engine:
    engine = create_engine(f"sqlite:///{db}", connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # noqa: ANN001 - DB-API connection
        # Let SQLAlchemy's begin event issue BEGIN itself so writes can take the lock up front.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # noqa: ANN001 - SQLAlchemy Connection
        immediate = conn.get_execution_options().get("quantyard_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _resolve(location: str) -> tuple[Engine, Path]:
    if location.startswith("sqlite:///"):
        db = Path(location.removeprefix("sqlite:///")).expanduser()
        root = db.parent
    elif "://" in location:
        raise RegistryError(f"unsupported registry URI {location!r}: expected a folder path or sqlite:///...")
    else:
        root = Path(location).expanduser()
        db = root / DB_NAME
    if root.exists() and not root.is_dir():
        raise RegistryPathError(
            f"registry location {root} is a file, expected a folder (or a missing path to create)",
            hint="point --registry / QUANTYARD_REGISTRY at a folder, e.g. ~/.local/share/quantyard/registry",
        )
    if db.exists() and not db.is_file():
        raise RegistryPathError(f"registry database {db} is not a file")
    return _sqlite_engine(db), root


def open_registry(location: str, *, create: bool = True) -> Registry:
    """Open (and, for a new location, create) a registry.

    Raises:
        RegistryPathError: the location is a file or otherwise unusable.
        RegistryError: the database schema is older than this Quantyard; run ``quantyard registry upgrade``.
    """
    root_probe = Path(location.removeprefix("sqlite:///")).expanduser() if "://" not in location or \
        location.startswith("sqlite:///") else None
    if root_probe is not None and not create and not root_probe.exists():
        raise RegistryPathError(f"no registry at {root_probe}", hint="run `quantyard convert` to create one")
    engine, root = _resolve(location)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise RegistryPathError(f"cannot create registry folder {root}: a path component is a file") from exc
    rev = current_revision(engine)
    if rev is None:
        upgrade(engine)
    elif rev != head_revision():
        raise RegistryError(
            f"registry schema at {location} is at revision {rev}, this Quantyard expects {head_revision()}",
            hint="back it up, then run `quantyard registry upgrade`",
        )
    return Registry(engine, LocalBlobStore(root / "blobs"), location)
