"""Real servers for registry tests, started on loopback in temp folders: PostgreSQL from the Debian
packages (``make setup`` installs them) and moto's standalone S3-compatible server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PG_USER = "quantyard"
S3_BUCKET = "quantyard-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pg_bindir() -> Path | None:
    """Where initdb/pg_ctl are: Debian keeps them in /usr/lib/postgresql/<major>/bin."""
    for cand in sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True):
        if (cand / "initdb").is_file() and (cand / "pg_ctl").is_file():
            return cand
    found = shutil.which("pg_ctl")
    return Path(found).resolve().parent if found else None


@dataclass
class PostgresServer:
    port: int
    base: Path

    def url(self, db: str, driver: str = "postgresql") -> str:
        return f"{driver}://{PG_USER}@127.0.0.1:{self.port}/{db}"

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(sql)  # type: ignore[arg-type]

    def new_database(self, template: str | None = None) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.admin(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return name


def _as_postgres_user() -> list[str]:
    # initdb and postgres refuse to run as root: CI runs as root, so drop to Debian's `postgres` user.
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL cluster on 127.0.0.1 in a temp folder (trust auth, fsync off: tests only)."""
    bindir = pg_bindir()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) not found: run `make setup` "
                                "(apt-get install postgresql)")
    base = Path(tempfile.mkdtemp(prefix="quantyard-pg-"))
    prefix = _as_postgres_user()
    if prefix:
        shutil.chown(base, user="postgres", group="postgres")
    data, log, port = base / "data", base / "server.log", free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": 120}
    try:
        subprocess.run([*prefix, str(bindir / "initdb"), "-D", str(data), "-U", PG_USER, "--auth=trust",
                        "-E", "UTF8", "--no-sync"], **run)  # type: ignore[call-overload]
        opts = (f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c fsync=off -c synchronous_commit=off "
                "-c full_page_writes=off -c max_connections=400")
        subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "120",
                        "-o", opts, "start"], **run)  # type: ignore[call-overload]
    except subprocess.CalledProcessError as exc:
        tail = log.read_text()[-2000:] if log.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"PostgreSQL failed to start: {exc.stderr}\n{tail}") from exc
    try:
        yield PostgresServer(port=port, base=base)
    finally:
        subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class S3Server:
    endpoint: str

    @property
    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": "quantyard", "secret": "quantyard-secret",
                "client_kwargs": {"region_name": "eu-west-1"}, "use_listings_cache": False}

    def new_prefix(self) -> str:
        return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"


@contextmanager
def s3_server(log_dir: Path) -> Iterator[S3Server]:
    """moto's standalone server (a real HTTP S3 endpoint) on 127.0.0.1, with one bucket."""
    import s3fs

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = (log_dir / "moto.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start; see {log_dir / 'moto.log'}") from None
                time.sleep(0.2)
        server = S3Server(endpoint)
        s3fs.S3FileSystem(**server.options).mkdir(S3_BUCKET)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
