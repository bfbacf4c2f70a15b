"""Serving results on the registry's pages, JSON API and model card: the p99 TTFT and throughput charts (one line
per variant and engine, legend, log y), the memory column, the compare page, the ``/-/serving`` endpoint, the
card's Serving section, and the labels (``¶`` CPU-scaled, ``§`` replaced kernel). Real SQLite registry of
SYNTHETIC serving results (tests/labelled_serving.py), real uvicorn server."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pipeline.serving_summary import serving_summaries
from pipeline.shown import CPU_SCALED, DENSE_KERNEL
from registry import open_registry
from registry.card import build_card
from registry.web.serving import build_serving_charts
from tests.labelled_serving import MODEL, SERVED, build_serving_registry, serving, sweep
from tests.registry.web.server import serving as serving_app

HTTP = httpx.Client(timeout=30)
SERVED_VARIANTS = sorted(v for v, (_, _, _, results) in SERVED.items() if any(r["kind"] == "serving" for r in results))


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("serving-web")
    return build_serving_registry(base / "registry", base / "files")


@pytest.fixture(scope="module")
def server(registry: Path) -> Iterator[str]:
    with serving_app(str(registry)) as url:
        yield url


def _row(page: str, variant: str) -> str:
    m = re.search(rf'<tr data-ref="{MODEL}/{re.escape(variant)}@1"[^>]*>(.*?)</tr>', page, re.S)
    assert m is not None, variant
    return m.group(0)


def _figure(page: str, chart_id: str) -> str:
    return page.split(f'<figure class="chart serving-chart" id="{chart_id}">')[1].split("</figure>")[0]


def test_model_page_draws_one_line_per_variant_and_engine(server: str) -> None:
    page = HTTP.get(f"{server}/models/{MODEL}").text
    for chart_id in ("serving-ttft", "serving-throughput"):
        fig = _figure(page, chart_id)
        refs = re.findall(r'<g class="series" data-ref="([^"]+)" data-engine="([^"]+)">', fig)
        assert sorted(r.split("/")[-1].removesuffix("@1") for r, _ in refs) == SERVED_VARIANTS
        assert ("acme/serving/AWQ-W4-G128-asym@1", "vllm") in refs
        assert fig.count('<span class="legend" data-ref=') == len(SERVED_VARIANTS)
        assert 'data-log="y"' in fig and "(log y)" in fig  # values span more than 10x
        assert [t for t in re.findall(r'text-anchor="middle">(\d+)</text>', fig)] == ["1", "8", "32", "64"]
    ttft = _figure(page, "serving-ttft")
    assert "AWQ-W4-G128-asym · vllm<span class=\"mark\">¶§</span>" in ttft
    assert ttft.count('class="point hollow"') == 1  # Q3_K_M's level with failed requests
    assert "hollow points: levels with failed requests" in ttft
    assert 'data-v="1400.0"' in ttft  # Q2_K's p99 TTFT at 32 users, unrounded
    assert "CPU-scaled load shapes (¶): AWQ-W4-G128-asym · vllm: CPU: scaled from the seed shape" in html.unescape(page)


def test_memory_column_says_what_fits_where(server: str) -> None:
    page = HTTP.get(f"{server}/models/{MODEL}").text
    q4 = _row(page, "Q4_K_M")
    assert 'data-v="5200000000"' in q4 and "fits in 5.20 GB at context 8,192 with 64 users" in q4
    assert "measured peak resident memory (RSS) of the server's processes (CPU)" in html.unescape(q4)
    assert '<td class="memory missing" data-v="">no serving result</td>' in _row(page, "EXL2-4.0bpw")
    awq = html.unescape(_row(page, "AWQ-W4-G128-asym"))
    assert "fits in 4.10 GB at context 4,096 with 64 users" in awq
    assert f'title="{CPU_SCALED.line}">¶</span>' in awq and f'title="{DENSE_KERNEL.line}">§</span>' in awq
    marks = page.split('id="marks"')[1].split("</ul>")[0]
    assert 'data-mark="cpu-scaled"' in marks and 'data-mark="dense-kernel"' in marks


def test_memory_sorts_server_side(server: str) -> None:
    page = HTTP.get(f"{server}/models/{MODEL}", params={"sort": "memory"}).text
    order = re.findall(r'<tr data-ref="acme/serving/([^@]+)@1"', page.split('id="variants"')[1].split("</table>")[0])
    assert order[0] == "Q2_K" and order[-2:] == ["Q8_0", "EXL2-4.0bpw"]  # no value sorts last


def test_serving_levels_table_lists_every_level(server: str) -> None:
    page = HTTP.get(f"{server}/models/{MODEL}").text
    table = page.split('id="serving-levels"')[1].split("</table>")[0]
    assert table.count('data-users="') == 4 * (len(SERVED_VARIANTS) - 1) + 2  # Q6_K ran 2 levels
    q3 = re.search(r'data-ref="acme/serving/Q3_K_M@1" data-engine="llama.cpp" data-users="32">(.*?)</tr>', table, re.S)
    assert q3 is not None and '<td class="n warn">3/200</td>' in q3.group(1)
    assert "llama-server <span class=\"muted\">SYNTHETIC</span>" in table
    assert "4-bit kernel: dense-matmul stand-in" in table


def test_compare_page_shows_the_same_figures(server: str) -> None:
    page = HTTP.get(f"{server}/compare", params={"ref": [f"{MODEL}/Q4_K_M", f"{MODEL}/AWQ-W4-G128-asym"]}).text
    memory = re.search(r'<tr data-key="memory">(.*?)</tr>', page, re.S)
    assert memory is not None and "fits in 5.20 GB at context 8,192 with 64 users" in memory.group(1)
    assert "best" not in memory.group(1)  # serving figures are not ranked
    fig = _figure(page, "serving-ttft")
    assert len(re.findall(r'<g class="series"', fig)) == 2
    assert "different load shapes" in page  # seed 512/256 and cpu-scaled 128/64


def test_api_serving_summary(server: str) -> None:
    data = HTTP.get(f"{server}/api/v1/models/{MODEL}/-/serving").json()
    by = {s["variant"]: s for s in data}
    assert sorted(by) == SERVED_VARIANTS
    q4 = by["Q4_K_M"]
    assert q4["engine"] == "llama.cpp" and q4["server_version"] == "SYNTHETIC" and q4["profile"] == "seed"
    assert [lv["concurrency"] for lv in q4["levels"]] == [1, 8, 32, 64]
    assert q4["memory"] == {"peak_bytes": 5_200_000_000, "source": "rss", "context": 8192, "users": 64,
                            "weights_bytes": 2_600_000_000, "kv_cache_bytes": 1_300_000_000, "kv_cache_tokens": 524288}
    assert by["AWQ-W4-G128-asym"]["cpu_scaled"] and by["AWQ-W4-G128-asym"]["kernel"].startswith("dequantized")
    assert "requests_log" not in str(data)
    rows = {r["variant"]: r for r in HTTP.get(f"{server}/api/v1/models/{MODEL}/-/table").json()}
    assert rows["Q4_K_M"]["memory_peak_bytes"] == 5_200_000_000 and rows["Q4_K_M"]["pp_tok_s"] is None
    results = HTTP.get(f"{server}/api/v1/versions/{MODEL}/Q4_K_M/-/results").json()
    assert [r["kind"] for r in results] == ["quality", "serving"]
    assert results[1]["metrics"]["levels"][0]["requests_log"]  # the full result keeps them


def test_linear_y_when_the_values_span_little() -> None:
    from registry.views import ResultView

    rec = serving("llama.cpp", sweep(100, 14, 85, users=(1, 2)), 1.0)
    r = ResultView(id=1, kind="serving", engine="llama.cpp", engine_version=None, window_set_id=None, status="ok",
                   metrics=rec["metrics"], hardware={}, error=None, wall_s=None, created_at="2026-01-01T00:00:00")
    built = build_serving_charts(serving_summaries("Q4_K_M", "m/Q4_K_M@1", "gguf", [r]))
    assert built is not None
    ttft = built.charts[0]
    assert ttft.log_y is False and ttft.y_ticks[0].label == "0" and [t.label for t in ttft.x_ticks] == ["1", "2"]
    assert build_serving_charts([]) is None


def test_card_has_a_serving_section(registry: Path) -> None:
    reg = open_registry(str(registry))
    views = [v for v in reg.latest_versions(MODEL) if v.variant in ("Q4_K_M", "AWQ-W4-G128-asym", "EXL2-4.0bpw")]
    text = build_card(views, repo_id="acme/serving-quants", base_model="acme/base", files=[], inputs=[],
                      window_sets=[], references=[]).text
    section = text.split("## Serving")[1].split("## Lineage")[0]
    lines = [line for line in section.splitlines() if line.startswith("| Q4_K_M |")]
    assert len(lines) == 4 and "| llama-server SYNTHETIC | seed | 1 |" in lines[0]
    assert "fits in 5.20 GB at context 8,192 with 64 users" in lines[0] and lines[1].endswith("|  |")
    awq = next(line for line in section.splitlines() if line.startswith("| AWQ-W4-G128-asym |"))
    assert "vllm serve SYNTHETIC¶§" in awq
    assert f"- {CPU_SCALED.line}\n" in section and f"- {DENSE_KERNEL.line}\n" in section
    assert "- Load: cpu-scaled profile, 128 prompt / 64 output tokens" in section
    assert "EXL2-4.0bpw" not in section  # never served
    quality = text.split("## Quality and speed")[1].split("## Serving")[0]
    assert "¶" not in quality


def test_version_page_shows_its_serving_and_no_request_logs(server: str) -> None:
    page = HTTP.get(f"{server}/versions/{MODEL}/Q4_K_M").text
    assert 'id="serving-ttft"' in page and "fits in 5.20 GB at context 8,192 with 64 users" in page
    results = page.split('id="results"')[1].split("</table>")[0]
    assert "1 records: see /-/results in the JSON API" in results and "token_times" not in results
