"""Serving results in the registry, on SQLite and on PostgreSQL: stored and returned whole (per-request logs
included), listed with the variant summaries, and never taken for a quality or speed result. The serving
metrics are SYNTHETIC (tests/labelled_serving.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.serving import ServingMetrics
from pipeline.serving_summary import parse_serving, serving_summaries
from pipeline.shown import pick
from registry.web.table import NOT_EVALUATED, NOT_SERVED, row_from_summary, row_from_version
from tests.labelled_serving import DENSE, GB, serving, sweep
from tests.registry.conftest import Backend
from tests.registry.helpers import request


def test_a_serving_result_round_trips(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    view = reg.register_version(request(tmp_path))
    record = serving("llama.cpp", sweep(40, 14, 85), 5.2)
    rid = reg.add_result(view.ref, record)
    got = reg.get_version(view.ref).results
    assert [(r.id, r.kind, r.engine, r.status) for r in got] == [(rid, "serving", "llama.cpp", "ok")]
    assert got[0].metrics == record["metrics"]  # every field, the per-request log included
    metrics = ServingMetrics.model_validate(got[0].metrics)
    assert metrics.levels[0].requests_log and metrics.memory.peak_bytes == int(5.2 * GB)
    summary = reg.variant_summaries("demo")[0]
    assert [r.kind for r in summary.results] == ["serving"]
    assert reg.get_version(view.ref).results[0].hardware["note"].startswith("SYNTHETIC")


def test_serving_is_never_a_quality_or_speed_result(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    view = reg.register_version(request(tmp_path))
    reg.add_result(view.ref, serving("vllm", sweep(300, 90, 12), 4.1, context=4096, cpu_scaled=True, flags=DENSE))
    reg.add_result(view.ref, {"kind": "serving", "engine": "llama.cpp", "status": "failed", "error": "server died"})
    v = reg.get_version(view.ref)
    picked = pick(v.format, v.results)
    assert (picked.quality, picked.speed, picked.others) == (None, None, ())
    for row in (row_from_version(v), row_from_summary(reg.variant_summaries("demo")[0])):
        assert row.ppl is None and row.pp_tok_s is None and row.engine is None
        assert (row.quality_reason, row.speed_reason) == (NOT_EVALUATED, NOT_EVALUATED)
        assert (row.memory_peak_bytes, row.memory_engine, row.memory_context) == (int(4.1 * GB), "vllm", 4096)
        assert set(row.marks) == {"cpu-scaled", "dense-kernel"}


def test_only_known_kinds_are_stored(tmp_path: Path, backend: Backend) -> None:
    reg = backend.open()
    view = reg.register_version(request(tmp_path))
    with pytest.raises(ValidationError):
        reg.add_result(view.ref, {"kind": "latency", "engine": "llama.cpp"})
    assert reg.get_version(view.ref).results == []


def test_summaries_take_the_newest_per_engine_and_skip_the_logs() -> None:
    from registry.views import ResultView

    def view(rid: int, engine: str, peak: float) -> ResultView:
        rec = serving(engine, sweep(40, 14, 85), peak)
        return ResultView(id=rid, kind="serving", engine=engine, engine_version=rec["engine_version"],
                          window_set_id=None, status="ok", metrics=rec["metrics"], hardware=rec["hardware"], error=None,
                          wall_s=None, created_at="2026-01-01T00:00:00")

    results = [view(1, "vllm", 6.0), view(2, "llama.cpp", 5.0), view(3, "llama.cpp", 5.5),
               ResultView(id=4, kind="serving", engine="llama.cpp", engine_version=None, window_set_id=None,
                          status="ok", metrics={"definitions": "another/9"}, hardware={}, error=None, wall_s=None,
                          created_at="2026-01-01T00:00:00")]
    out = serving_summaries("Q4_K_M", "m/Q4_K_M@1", "gguf", results)
    assert [(s.engine, s.result_id, s.role) for s in out] == [("llama.cpp", 3, "engine"), ("vllm", 1, "other")]
    assert out[0].memory.text == "fits in 5.50 GB at context 8,192 with 64 users" and out[0].memory.source == "rss"
    parsed = parse_serving(results[0].metrics)
    assert parsed is not None and all(not lv.requests_log for lv in parsed.levels)
    assert row_from_summary_reason() == NOT_SERVED


def row_from_summary_reason() -> str | None:
    from registry.views import VariantSummary

    row = row_from_summary(VariantSummary(model="m", variant="F16", format="gguf", spec={"type": "F16"}, version=1,
                                          versions=1, state="candidate", created_at=None))
    return row.reason("memory")
