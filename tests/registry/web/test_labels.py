"""The registry's pages, chart and JSON table on a registry holding every kind of labelled number
(tests/labelled.py): a stand-in, a KLD bound, an estimate, a cross-check, a dense-matmul kernel speed, two
window sets. Real SQLite registry, real uvicorn server."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pipeline.shown import CROSS_CHECK, DENSE_KERNEL, KLD_ESTIMATE, KLD_LOWER_BOUND, stand_in_mark
from registry import open_registry
from registry.web.chart import build_chart
from registry.web.table import row_from_summary
from tests.labelled import AWQ_TRANSFORMERS_KLD, AWQ_VLLM_KLD, EXACT_KLD, LEGACY_KLD, WS1, WS2, build_labelled_registry
from tests.registry.web.server import serving

HTTP = httpx.Client(timeout=30)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("labelled-web")
    return build_labelled_registry(base / "registry", base / "files")


@pytest.fixture(scope="module")
def server(labelled: Path) -> Iterator[str]:
    with serving(str(labelled)) as url:
        yield url


def _row(page: str, variant: str) -> str:
    m = re.search(rf'<tr data-ref="acme/labels/{re.escape(variant)}@1"[^>]*>(.*?)</tr>', page, re.S)
    assert m is not None, variant
    return m.group(0)


def _cell(row: str, key: str) -> str:
    m = re.search(rf'<td class="n m-{key}[^"]*"[^>]*>([^<]*)</td>', row)
    assert m is not None, key
    return m.group(1)


def test_stand_in_and_exact_rows_look_different(server: str) -> None:
    page = HTTP.get(server + "/models/acme/labels").text
    exact, exl2 = _row(page, "Q8_0"), _row(page, "EXL2-4.0bpw-ref")
    assert 'class="role-engine"' in exact and "badge stand-in" not in exact
    assert 'class="role-stand-in"' in exl2 and '<span class="badge stand-in"' in exl2
    assert "exl2-reference</span><span class=\"mark\"" in exl2  # the engine carries its marker
    assert _cell(exact, "kld") == "1.235e-06" and "kld-exact" in exact
    assert 'data-v="1.234567890123e-06"' in exact  # the sort value is unrounded
    marks = re.search(r'<ul class="marks" id="marks">(.*?)</ul>', page, re.S)
    assert marks is not None
    for mark in (KLD_LOWER_BOUND, KLD_ESTIMATE, DENSE_KERNEL, CROSS_CHECK, stand_in_mark("exl2", "exl2-reference"),
                 stand_in_mark("awq", "transformers")):
        assert f'data-mark="{mark.key}"' in marks.group(1), mark.key
    assert "dequantized EXL2 weights in fp32 transformers, not ExLlamaV2&#39;s kernels; quality only, no speed" in \
        marks.group(1)


def test_bounds_and_estimates_are_marked_and_exact_values_are_not(server: str) -> None:
    page = HTTP.get(server + "/models/acme/labels").text
    assert _cell(_row(page, "Q4_K_M"), "kld") == "≥4.081e-02†"
    assert _cell(_row(page, "AWQ-W8-legacy"), "kld") == "≈3.300e-05‡"
    assert "†" not in _cell(_row(page, "AWQ-W4-G128-asym"), "kld") and "§" not in _cell(_row(page, "Q8_0"), "kld")


def test_awq_shows_vllm_and_labels_the_transformers_cross_check(server: str) -> None:
    page = HTTP.get(server + "/models/acme/labels").text
    awq = _row(page, "AWQ-W4-G128-asym")
    # its quality figures were computed with the dense-matmul kernel stand-in too: marked like its speeds
    assert _cell(awq, "kld") == f"{AWQ_VLLM_KLD:.3e}§" and '<span class="engine role-engine">vllm</span>' in awq
    assert _cell(awq, "ppl").endswith("§")
    second = re.search(r'<div class="second role-cross-check"[^>]*>([^<]*)</div>', awq)
    assert second is not None and second.group(1).startswith("× cross-check on transformers:")
    assert f"KLD {AWQ_TRANSFORMERS_KLD:.3e}" in second.group(1)
    # the dense-matmul kernel stand-in is said next to both speeds
    assert _cell(awq, "pp_tok_s") == "5,475§" and _cell(awq, "tg_tok_s") == "136§"
    assert f'title="{DENSE_KERNEL.line}' in html.unescape(awq)
    only_transformers = _row(page, "AWQ-W4-G64-asym")
    assert 'class="role-stand-in"' in only_transformers and "badge stand-in" in only_transformers


def test_the_chart_keeps_stand_ins_and_bounds_off_the_front_and_says_so(labelled: Path) -> None:
    rows = [row_from_summary(s) for s in open_registry(str(labelled)).variant_summaries("acme/labels")]
    chart = build_chart(rows)
    assert chart is not None and chart.metric == "kld"
    points = {p.label: p for p in chart.points}
    assert {v for v, p in points.items() if p.shape == "diamond"} == {"EXL2-4.0bpw-ref", "AWQ-W4-G64-asym"}
    assert {v for v, p in points.items() if p.hollow} == {"EXL2-4.0bpw-ref", "AWQ-W4-G64-asym", "Q4_K_M",
                                                           "AWQ-W8-legacy"}
    assert not any(p.on_front for p in points.values() if p.hollow)
    assert {v for v, p in points.items() if p.on_front} == {"Q8_0", "AWQ-W4-G128-asym"}  # exact, engine-measured
    notes = " ".join(chart.notes)
    assert "stand-in engines (exl2-reference, transformers)" in notes and "not on the front: AWQ-W8-legacy, Q4_K_M" \
        in notes


def test_chart_markup_draws_stand_ins_as_diamonds_with_a_legend(server: str) -> None:
    page = HTTP.get(server + "/models/acme/labels").text
    chart = page.split('<figure class="chart"')[1].split("</figure>")[0]
    assert chart.count('<path class="marker stand-in hollow"') == 2
    assert chart.count('data-role="stand-in"') == 2 and 'id="legend-stand-in"' in chart
    assert "engine-measured points of one KLD kind only" in chart


def test_the_json_table_is_raw_and_says_what_each_number_is(server: str) -> None:
    rows = {r["variant"]: r for r in HTTP.get(server + "/api/v1/models/acme/labels/-/table").json()}
    assert rows["Q8_0"]["kld"] == EXACT_KLD and rows["Q8_0"]["kld_kind"] == "exact"
    assert rows["Q4_K_M"]["kld"] is None and rows["Q4_K_M"]["kld_lower_bound"] == LEGACY_KLD
    awq = rows["AWQ-W4-G128-asym"]
    assert (awq["engine"], awq["kld"], awq["cross_checks"][0]["engine"]) == ("vllm", AWQ_VLLM_KLD, "transformers")
    assert awq["speed_kernel"].startswith("dequantized") and rows["EXL2-4.0bpw-ref"]["engine_role"] == "stand-in"


def test_compare_page_names_the_sets_and_ranks_no_mixed_kld(server: str) -> None:
    page = HTTP.get(server + "/compare", params={"ref": ["acme/labels/Q8_0", "acme/labels/Q4_K_M",
                                                          "acme/labels/EXL2-4.0bpw-ref"]}).text
    kld_row = re.search(r'<tr data-key="kld">(.*?)</tr>', page, re.S)
    assert kld_row is not None and "best" not in kld_row.group(1) and "≥4.081e-02†" in kld_row.group(1)
    assert 'id="sets-note"' in page and "reference not recorded: Q4_K_M" in page
    assert '<span class="badge stand-in"' in page and 'id="marks"' in page
    sets = HTTP.get(server + "/compare", params={"ref": ["acme/sets/A", "acme/sets/C"]}).text
    assert f"window set {WS1[:12]}" in sets and f"window set {WS2[:12]}" in sets
    same = HTTP.get(server + "/compare", params={"ref": ["acme/sets/A", "acme/sets/B"]}).text
    assert 'id="sets-note"' not in same and 'class="n best">1.000e-03' in same


def test_model_page_notes_two_window_sets(server: str) -> None:
    page = HTTP.get(server + "/models/acme/sets").text
    note = re.search(r'<p class="warn" id="sets-note">(.*?)</p>', page, re.S)
    assert note is not None
    assert f"window set {WS1[:12]}, reference" in note.group(1) and ": A, B;" in note.group(1)
    assert f"window set {WS2[:12]}" in note.group(1) and note.group(1).count(": C") == 1


def test_the_history_across_versions_marks_a_stand_in_engine(server: str) -> None:
    page = HTTP.get(server + "/versions/acme/labels/EXL2-4.0bpw-ref").text
    history = page.split('id="history"')[1].split("</table>")[0]
    assert 'exl2-reference<span class="mark"' in history and ">*</span>" in history, history


def test_version_page_labels_each_result(server: str) -> None:
    page = HTTP.get(server + "/versions/acme/labels/AWQ-W4-G128-asym").text
    results = page.split('id="results"')[1].split("</table>")[0]
    assert results.count('class="badge role-cross-check"') == 1 and 'data-mark="dense-kernel"' in page
