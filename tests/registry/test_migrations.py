"""Schema history: a registry created by an older Quantyard (revision 0001, holding data) migrates to
head with nothing lost, on SQLite and PostgreSQL; `quantyard registry upgrade` runs it; an old
registry is refused until it is upgraded."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import RegistryError
from registry import _resolve, close_engines, current_revision, head_revision, open_registry, upgrade
from tests.registry.helpers import request as make_request
from tests.registry.servers import PostgresServer

OLD_TABLES = ("models", "sources", "blobs", "source_artifacts", "variants", "versions", "version_files", "results")
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
TOOL = {"name": "llama.cpp", "llama_cpp_python": "0.3.36"}


def _location(kind: str, tmp_path: Path, request_: pytest.FixtureRequest) -> str:
    if kind == "sqlite":
        return str(tmp_path / "old-registry")
    server: PostgresServer = request_.getfixturevalue("pg_server")
    return server.url(server.new_database())


def _fill_0001(conn: sa.Connection) -> None:
    """What a registry written at revision 0001 holds: two variants, three versions, results, an artifact."""
    t = {name: sa.Table(name, sa.MetaData(), autoload_with=conn) for name in OLD_TABLES}
    conn.execute(t["models"].insert(), [{"id": 1, "name": "demo", "architecture": "LlamaForCausalLM",
                                         "created_at": NOW}])
    conn.execute(t["sources"].insert(), [{"id": 1, "model_id": 1, "kind": "local", "path": "/src",
                                          "identity": "local:sha256:" + "f" * 64, "content_hash": "f" * 64,
                                          "created_at": NOW}])
    conn.execute(t["blobs"].insert(), [{"sha256": c * 64, "size": 10 + i, "created_at": NOW}
                                       for i, c in enumerate("abc")])
    conn.execute(t["source_artifacts"].insert(), [{"id": 1, "source_id": 1, "kind": "window_set", "key": "k" * 64,
                                                   "name": "windows.npz", "sha256": "c" * 64, "size": 12,
                                                   "meta": {"id": "ws1"}, "created_at": NOW}])
    conn.execute(t["variants"].insert(), [{"id": 1, "model_id": 1, "name": "Q8_0", "format": "gguf",
                                           "spec": {"type": "Q8_0"}, "created_at": NOW},
                                          {"id": 2, "model_id": 1, "name": "Q4_K_M", "format": "gguf",
                                           "spec": {"type": "Q4_K_M"}, "created_at": NOW}])
    lineage = {"tool": TOOL, "parameters": {"type": "Q8_0"}}
    conn.execute(t["versions"].insert(), [
        {"id": 1, "variant_id": 1, "number": 1, "source_id": 1, "build_key": "b1", "state": "validated",
         "lineage": lineage, "created_at": NOW},
        {"id": 2, "variant_id": 1, "number": 2, "source_id": 1, "build_key": "b2", "state": "candidate",
         "lineage": lineage, "created_at": NOW},
        {"id": 3, "variant_id": 2, "number": 1, "source_id": 1, "build_key": "b3", "state": "candidate",
         "lineage": {**lineage, "inputs": [{"kind": "imatrix", "sha256": "d" * 64, "name": "imatrix.dat"}]},
         "created_at": NOW}])
    conn.execute(t["version_files"].insert(), [
        {"id": i + 1, "version_id": i + 1, "name": f"f{i}.gguf", "sha256": "ab"[i % 2] * 64, "size": 10 + i % 2}
        for i in range(3)])
    conn.execute(t["results"].insert(), [{"id": 1, "version_id": 1, "kind": "quality", "engine": "llama.cpp",
                                          "status": "ok", "metrics": {"ppl": 12.5}, "hardware": {},
                                          "created_at": NOW}])


def _dump(conn: sa.Connection) -> dict[str, Any]:
    out = {}
    for name in OLD_TABLES:
        table = sa.Table(name, sa.MetaData(), autoload_with=conn)
        rows = conn.execute(sa.select(table).order_by(*table.primary_key.columns)).mappings().all()
        out[name] = [{k: (json.loads(v) if isinstance(v, str) and v[:1] in "{[" else v) for k, v in r.items()}
                     for r in rows]
    return out


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_old_schema_with_data_migrates_to_head(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    location = _location(kind, tmp_path, request)
    if kind == "sqlite":
        Path(location).mkdir()
    engine, _, _ = _resolve(location)
    upgrade(engine, "0001_initial")
    with engine.begin() as conn:
        _fill_0001(conn)
    with engine.connect() as conn:
        before = _dump(conn)

    with pytest.raises(RegistryError, match="registry upgrade"):
        open_registry(location, blobs=str(tmp_path / "blobs"))
    result = CliRunner().invoke(app, ["registry", "upgrade", "--registry", location])
    assert result.exit_code == 0, result.output
    assert "0001_initial →" in result.output and current_revision(engine) == head_revision()

    with engine.connect() as conn:
        assert _dump(conn) == before  # every old row, byte for byte
    reg = open_registry(location, blobs=str(tmp_path / "blobs"))
    assert reg.aliases("demo", "Q8_0") == {"latest": 2} and reg.aliases("demo", "Q4_K_M") == {"latest": 1}
    assert reg.get_version("demo/Q8_0").number == 2
    v1 = reg.get_version("demo/Q8_0@1")
    assert v1.state == "validated" and v1.results[0].metrics == {"ppl": 12.5}
    assert {(i.kind, i.ref) for i in v1.inputs} == {("source", "local:sha256:" + "f" * 64),
                                                   ("tool", "llama.cpp@llama_cpp_python=0.3.36")}
    assert [v.ref for v in reg.derived_from("d" * 64, kind="imatrix")] == ["demo/Q4_K_M@1"]
    events = sorted((e.action, e.name, e.new, e.actor) for e in reg.audit_log("demo"))
    assert events == [("alias.set", "latest", "1", "migration:0002"), ("alias.set", "latest", "2", "migration:0002")]
    assert reg.register_version(make_request(tmp_path, key='new')).number == 3  # numbering continues

    again = CliRunner().invoke(app, ["registry", "upgrade", "--registry", location])
    assert again.exit_code == 0 and "already at" in again.output
    close_engines()
