"""Set-based listing queries (web pages, API) agree with the per-version API, on SQLite and PostgreSQL,
and their query count does not grow with the number of variants."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import event

from pipeline.errors import NotFoundError
from registry.store import Registry
from tests.registry.conftest import Backend
from tests.registry.helpers import request


def _fill(reg: Registry, tmp: Path, n: int) -> None:
    for i in range(n):
        reg.register_version(request(tmp, name=f"V{i}", key=f"k{i}", data=f"v{i}".encode() * 50))
    reg.register_version(request(tmp, name="V0", key="k0b", data=b"second"))  # V0@2 is latest
    reg.set_alias("demo/V0@1", "production")
    reg.add_result("demo/V1@1", {"kind": "quality", "engine": "llama.cpp", "status": "ok", "window_set_id": "w",
                                 "metrics": {"ppl": 11.0, "kld_mean": 0.01}})
    reg.add_result("demo/V1@1", {"kind": "speed", "engine": "llama.cpp", "status": "failed", "error": "boom"})
    reg.register_version(request(tmp, model="acme/other", name="Q8_0", data=b"other"))


def test_variant_summaries_match_latest_versions(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    _fill(reg, tmp_path, 3)
    summaries = reg.variant_summaries("demo")
    latest = reg.latest_versions("demo")
    assert [s.variant for s in summaries] == [v.variant for v in latest] == ["V0", "V1", "V2"]
    for s, v in zip(summaries, latest, strict=True):
        assert (s.ref, s.version, s.state, s.format, s.spec) == (v.ref, v.number, v.state, v.format, v.spec)
        assert (s.size, s.files) == (v.size, len(v.files))
        assert s.results == v.results and s.source["identity"] == v.source["identity"]
        assert s.aliases == reg.aliases("demo", s.variant)
    assert summaries[0].versions == 2 and summaries[0].aliases == {"latest": 2, "production": 1}
    assert [r.kind for r in summaries[1].results] == ["quality", "speed"]
    assert reg.variant_summaries("demo", format="awq") == []
    with pytest.raises(NotFoundError):
        reg.variant_summaries("nope")


def test_list_models_counts_and_filters(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    _fill(reg, tmp_path, 2)
    assert [(m.name, m.variants, m.versions, m.formats) for m in reg.list_models()] == [
        ("acme/other", 1, 1, ["gguf"]), ("demo", 2, 3, ["gguf"])]
    assert [m.name for m in reg.list_models(query="OTH")] == ["acme/other"]
    assert [m.name for m in reg.list_models(query="%")] == []  # LIKE wildcards are literal
    assert [m.name for m in reg.list_models(query="_")] == []


def _count_queries(reg: Registry, fn: object) -> int:
    seen: list[str] = []

    def before(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    event.listen(reg.engine, "before_cursor_execute", before)
    try:
        fn()  # type: ignore[operator]
    finally:
        event.remove(reg.engine, "before_cursor_execute", before)
    return len([s for s in seen if s.lstrip().upper().startswith("SELECT")])


def test_listing_query_count_is_constant(tmp_path: Path, registry_path: Path) -> None:
    from registry import open_registry

    reg = open_registry(str(registry_path))
    _fill(reg, tmp_path, 3)
    small = _count_queries(reg, lambda: reg.variant_summaries("demo"))
    models_small = _count_queries(reg, reg.list_models)
    for i in range(3, 23):
        reg.register_version(request(tmp_path, name=f"V{i}", key=f"k{i}", data=f"v{i}".encode()))
    assert _count_queries(reg, lambda: reg.variant_summaries("demo")) == small <= 7
    assert _count_queries(reg, reg.list_models) == models_small <= 4


def test_generation_moves_with_every_write(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    seen = [reg.generation()]

    def moved() -> bool:
        seen.append(reg.generation())
        return seen[-1] != seen[-2]

    v = reg.register_version(request(tmp_path))
    assert moved()
    assert not moved()  # reads leave it alone
    reg.add_result(v.ref, {"kind": "quality", "engine": "e", "status": "ok", "metrics": {}})
    assert moved()
    reg.set_alias(v.ref, "production")
    assert moved()
    reg.set_state(v.ref, "validated")
    assert moved()
    reg.delete_alias("demo", "Q8_0", "production")
    assert moved()
    reg.register_version(request(tmp_path))  # the same build key: nothing registered
    assert not moved()
    assert len(set(seen)) == 6
