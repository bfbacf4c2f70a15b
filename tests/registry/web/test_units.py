"""The web layer's pure parts: Range parsing, the held-back verified stream, the Pareto front, the chart
layout, the table's reasons for missing metrics."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.errors import IntegrityError
from registry.views import ResultView
from registry.web.chart import build_chart
from registry.web.downloads import RangeNotSatisfiable, held_back, parse_range
from registry.web.format import metric_cells, number
from registry.web.table import (
    ENGINE_UNAVAILABLE,
    EVAL_FAILED,
    NOT_EVALUATED,
    Row,
    chart_floor,
    metric_fields,
    pareto_front,
    quant_label,
    sort_rows,
    with_floors,
)


@pytest.mark.parametrize(("header", "size", "expected"), [
    (None, 10, None), ("", 10, None), ("bytes=0-0", 10, (0, 0)), ("bytes=2-", 10, (2, 9)), ("bytes=-3", 10, (7, 9)),
    ("bytes=-30", 10, (0, 9)), ("bytes=5-500", 10, (5, 9)), ("bytes=9-9", 10, (9, 9)), (" bytes=1-2 ", 10, (1, 2)),
    ("bytes=3-1", 10, None), ("bytes=-", 10, None), ("bytes=0-1,3-4", 10, None), ("pages=1-2", 10, None),
    ("bytes=a-b", 10, None), ("bytes=1-2-3", 10, None),
])
def test_parse_range(header: str | None, size: int, expected: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == expected


@pytest.mark.parametrize(("header", "size"), [("bytes=10-", 10), ("bytes=10-20", 10), ("bytes=-0", 10),
                                              ("bytes=0-", 0), ("bytes=-5", 0)])
def test_parse_range_unsatisfiable(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, size)


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 10_000))
def test_parse_range_stays_inside_the_file(a: int, b: int, size: int) -> None:
    try:
        span = parse_range(f"bytes={a}-{b}", size)
    except RangeNotSatisfiable:
        assert a >= size
        return
    assert (span is None and b < a) or (span is not None and 0 <= span[0] <= span[1] < size)


def _verified(chunks: list[bytes], digest: str) -> object:
    """Like BlobStore.iter_verified: yields, then raises after the last chunk on a mismatch."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
        yield c
    if h.hexdigest() != digest:
        raise IntegrityError("corrupt")


def test_held_back_withholds_the_last_chunk_of_a_corrupt_stream() -> None:
    chunks = [b"a" * 4, b"b" * 4, b"c" * 4]
    good = hashlib.sha256(b"".join(chunks)).hexdigest()
    assert b"".join(held_back(_verified(chunks, good))) == b"".join(chunks)  # type: ignore[arg-type]
    sent: list[bytes] = []
    with pytest.raises(IntegrityError):
        for c in held_back(_verified(chunks, "0" * 64)):  # type: ignore[arg-type]
            sent.append(c)
    assert sent == chunks[:-1]  # the client never gets the whole body
    assert list(held_back(iter([]))) == []


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 100)), max_size=30))
def test_pareto_front_matches_brute_force(points: list[tuple[float, float]]) -> None:
    front = pareto_front(points)
    dominated = {i for i, (x, y) in enumerate(points) for (u, v) in points
                 if u <= x and v <= y and (u < x or v < y)}
    best = {}
    for i, p in enumerate(points):  # duplicates: exactly one of them is on the front
        if i not in dominated:
            best.setdefault(p, i)
    assert sorted(front) == sorted(best.values())
    assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)


def _row(variant: str, size: int | None, kld: float | None = None, ppl: float | None = None, fmt: str = "gguf") -> Row:
    return Row(ref=f"m/{variant}@1", model="m", variant=variant, version=1, format=fmt, quant=variant,
               state="candidate", size=size, kld=kld, ppl=ppl, quality_reason=None if kld or ppl else NOT_EVALUATED)


def test_chart_uses_kld_on_a_log_scale_and_draws_the_front() -> None:
    rows = [_row("a", 2_000_000, 1e-2), _row("b", 3_000_000, 5e-4, fmt="awq"), _row("c", 4_000_000, 2e-3, fmt="exl2"),
            _row("d", 9_000_000, 1e-6), _row("e", 5_000_000), _row("f", None, 1e-3)]
    chart = build_chart(rows)
    assert chart is not None and chart.metric == "kld" and chart.x_label == "size (MB)"
    assert {p.label: p.on_front for p in chart.points} == {"a": True, "b": True, "c": False, "d": True}
    assert [t.label for t in chart.y_ticks] == ["1e-6", "1e-5", "1e-4", "1e-3", "1e-2"]
    assert chart.not_plotted == [("e", NOT_EVALUATED), ("f", "no size")]
    assert [c for _, c in chart.legend] == ["#d62728", "#2ca02c", "#1f77b4"]  # awq, exl2, gguf
    ys = {p.label: p.y for p in chart.points}
    assert ys["d"] > ys["b"] > ys["a"]  # SVG y grows downwards: lower KLD is lower on the chart
    xs = [x for x, _ in chart.front]
    assert xs == sorted(xs) and len(xs) == 3


def test_chart_draws_the_noise_floor_and_marks_the_rows_within_it() -> None:
    """The floor is a line (with its 95 % band) on the KLD axis, the axis reaches down to it, and a row whose exact
    KLD interval reaches the floor's of its own reference is marked ≃; rows of another reference are not."""
    rows = [_row("a", 2_000_000, 1e-2), _row("b", 4_000_000, 1.1e-4), _row("c", 3_000_000, 2e-3)]
    rows = [r.model_copy(update={"reference_key": "ref1"}) for r in rows]
    rows.append(_row("d", 5_000_000, 1e-4).model_copy(update={"reference_key": "ref2"}))
    floors = {"ref1": {"kld_mean": 1e-5, "kld_ci95_low": 5e-6, "kld_ci95_high": 1.2e-4, "engine": "llama.cpp"}}
    marked = with_floors(rows, floors)
    assert [r.within_noise_floor for r in marked] == [False, True, False, False]
    assert "noise-floor" in marked[1].marks and metric_cells(marked[1])[4].text.endswith("≃")
    floor = chart_floor(marked, floors)
    assert floor is not None and (floor["rows"], floor["of"]) == (3, 4)
    chart = build_chart(marked, floor)
    assert chart is not None and chart.floor_y is not None and chart.floor_band is not None
    assert next(t.label for t in chart.y_ticks) == "1e-6"  # the axis reaches down to the floor's band
    ys = {p.label: p.y for p in chart.points}
    assert chart.floor_band[0] <= chart.floor_y <= chart.floor_band[1]
    assert ys["b"] < chart.floor_y  # above the floor line (SVG y grows downwards)
    assert "3 of the 4 rows" in str(chart.floor_label)
    assert build_chart(marked).floor_y is None  # type: ignore[union-attr]
    assert chart_floor(marked, {}) is None


def test_chart_falls_back_to_ppl_and_to_nothing() -> None:
    chart = build_chart([_row("a", 10, ppl=12.0), _row("b", 20, ppl=11.0)])
    assert chart is not None and chart.metric == "ppl" and chart.x_label == "size (B)"
    assert all(p.on_front for p in chart.points)
    assert build_chart([_row("a", 10)]) is None


def _result(kind: str, status: str, error: str | None = None, **metrics: object) -> ResultView:
    return ResultView(id=1, kind=kind, engine="e", engine_version="1", window_set_id="w", status=status,
                      metrics=dict(metrics), hardware={}, error=error, wall_s=None, created_at="")


def test_reasons_for_missing_metrics() -> None:
    assert metric_fields("gguf", [])["quality_reason"] == NOT_EVALUATED
    failed = metric_fields("gguf", [_result("quality", "failed", "EngineError: crashed")])
    assert (failed["quality_reason"], failed["speed_reason"]) == (EVAL_FAILED, EVAL_FAILED)
    for r in (_result("quality", "unavailable"), _result("quality", "skipped"),
              _result("quality", "failed", "ToolchainMissingError: no vllm env")):
        assert metric_fields("gguf", [r])["quality_reason"] == ENGINE_UNAVAILABLE
    retried = metric_fields("gguf", [_result("quality", "failed", "x"), _result("quality", "ok", ppl=9.0, kld_mean=0.1,
                                                                        top1_agreement=0.5)])
    assert retried["ppl"] == 9.0 and retried["top1_pct"] == 50.0 and "quality_reason" not in retried
    speed_only = metric_fields("gguf", [_result("quality", "ok", ppl=9.0), _result("speed", "ok", decode_tok_per_s=3)])
    assert speed_only["tg_tok_s"] == 3.0 and speed_only["pp_tok_s"] is None


def test_cells_say_why_and_sorting_puts_missing_last() -> None:
    rows = [_row("a", 10, 0.5), _row("b", 20), _row("c", 30, 0.1)]
    cells = {c.css.split()[1]: c for c in metric_cells(rows[1])}
    assert cells["m-kld"].value == "" and cells["m-kld"].text == NOT_EVALUATED
    assert cells["m-size"].text == "20 B" and cells["m-size"].value == "20"
    assert [r.variant for r in sort_rows(rows, "kld")] == ["c", "a", "b"]
    assert [r.variant for r in sort_rows(rows, "kld", descending=True)] == ["a", "c", "b"]
    assert [r.variant for r in sort_rows(rows, "nonsense")] == ["a", "b", "c"]


def test_labels_and_numbers() -> None:
    assert quant_label("gguf", {"type": "Q4_K_M", "imatrix": True}) == "Q4_K_M (imatrix)"
    assert quant_label("exl2", {"bpw": 4.0, "head_bits": 6}) == "4.0 bpw, head 6"
    assert quant_label("awq", {"bits": 4, "group_size": 128, "symmetric": True}) == "W4 g128 sym"
    assert quant_label("future", {}) == "future"
    assert number(3.6e-4, "kld") == "3.600e-04" and number(-0.008, "delta_ppl_pct") == "-8.0e-03"
    assert number(2.261, "delta_ppl_pct") == "+2.261" and number(6947.2, "pp_tok_s") == "6,947"
    assert number(None) == "" and number(math.nan) == ""
