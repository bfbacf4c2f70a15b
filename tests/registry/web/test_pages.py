"""Server-rendered pages on a real server: index search and filters, model page table and chart,
version page, compare page, autoescaping of every user-supplied string, and no external assets."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.registry.web.conftest import HOSTILE

HTTP = httpx.Client(timeout=30)


def test_index_search_and_filters(small_server: str) -> None:
    page = HTTP.get(small_server + "/").text
    assert 'href="/models/acme/tiny"' in page and 'href="/models/other"' in page
    only_awq = HTTP.get(small_server + "/", params={"format": "awq"}).text
    assert 'href="/models/acme/tiny"' in only_awq and 'href="/models/other"' not in only_awq
    mamba = HTTP.get(small_server + "/", params={"architecture": "MambaForCausalLM"}).text
    assert 'href="/models/other"' in mamba and 'href="/models/acme/tiny"' not in mamba
    search = HTTP.get(small_server + "/", params={"q": "TIN"}).text
    assert "1 of 2 models" in search
    none = HTTP.get(small_server + "/", params={"q": HOSTILE}).text
    assert "No model matches." in none and HOSTILE not in none and "&lt;script&gt;" in none


def test_model_page_table_chart_and_reasons(small_server: str) -> None:
    r = HTTP.get(small_server + "/models/acme/tiny")
    assert r.status_code == 200
    page = r.text
    assert "acme/tiny" in page and "c0ffee" * 6 + "ab12" in page and "revision <code>main</code>" in page
    rows = re.findall(r'<tr data-ref="([^"]+)"', page)
    assert rows == ["acme/tiny/AWQ-W4-G128-asym@1", "acme/tiny/EXL2-4.0bpw@1", "acme/tiny/F16@1", "acme/tiny/Q2_K@1",
                    "acme/tiny/Q4_K_M@1", "acme/tiny/Q8_0@2"]
    assert page.count('class="marker') == 4  # the four variants with a KLD
    assert "Not plotted: F16 (not evaluated), Q2_K (evaluation failed)" in page
    assert 'data-metric="kld"' in page and '<polyline class="front"' in page
    for reason in ("not evaluated", "evaluation failed", "engine unavailable"):
        assert f">{reason}</td>" in page
    assert 'title="ToolchainMissingError: ExLlamaV2 needs a CUDA GPU"' in page
    assert "production→@1" in page  # the alias on Q8_0's older version


def test_model_page_server_side_sort_and_format_filter(small_server: str) -> None:
    page = HTTP.get(small_server + "/models/acme/tiny", params={"sort": "kld", "dir": "asc"}).text
    rows = re.findall(r'<tr data-ref="acme/tiny/([^@"]+)@', page)
    assert rows == ["Q8_0", "AWQ-W4-G128-asym", "EXL2-4.0bpw", "Q4_K_M", "F16", "Q2_K"]  # missing ones last
    desc = re.findall(r'<tr data-ref="acme/tiny/([^@"]+)@',
                      HTTP.get(small_server + "/models/acme/tiny", params={"sort": "kld", "dir": "desc"}).text)
    assert desc == ["Q4_K_M", "EXL2-4.0bpw", "AWQ-W4-G128-asym", "Q8_0", "F16", "Q2_K"]
    gguf = HTTP.get(small_server + "/models/acme/tiny", params={"format": "gguf", "sort": "bogus'\"<"}).text
    assert re.findall(r'<tr data-ref="acme/tiny/([^@"]+)@', gguf) == ["F16", "Q2_K", "Q4_K_M", "Q8_0"]
    assert "bogus" not in gguf


def test_model_page_charts_ppl_when_no_kld(small_server: str) -> None:
    page = HTTP.get(small_server + "/models/other").text
    assert 'id="no-chart"' in page  # nothing evaluated: no chart, and it says so


def test_version_page(small_server: str) -> None:
    page = HTTP.get(small_server + "/versions/acme/tiny/Q8_0@production").text
    assert "you asked for <code>acme/tiny/Q8_0@production</code>" in page
    assert 'href="/api/v1/versions/acme/tiny/Q8_0@1/-/files/tiny-Q8_0.gguf"' in page
    assert "quantyard pull acme/tiny/Q8_0@1 acme--tiny-Q8_0" in page
    assert "llama-server -m acme--tiny-Q8_0/tiny-Q8_0.gguf --port 8080" in page
    assert re.search(r'<tr class="current">\s*<td><a href="/versions/acme/tiny/Q8_0@1">@1</a>', page)
    assert "/versions/acme/tiny/Q8_0@2" in page  # history lists the other version
    awq = HTTP.get(small_server + "/versions/acme/tiny/AWQ-W4-G128-asym").text
    assert "vllm serve acme--tiny-AWQ-W4-G128-asym --served-model-name AWQ-W4-G128-asym" in awq
    assert 'href="/api/v1/versions/acme/tiny/AWQ-W4-G128-asym@1/-/files/nested/dir/part.bin"' in awq
    exl2 = HTTP.get(small_server + "/versions/acme/tiny/EXL2-4.0bpw").text
    assert "python main.py --model-dir . --model-name acme--tiny-EXL2-4.0bpw" in exl2


def test_compare_page(small_server: str) -> None:
    refs = ["acme/tiny/Q4_K_M", "acme/tiny/AWQ-W4-G128-asym@1", "acme/tiny/EXL2-4.0bpw@latest"]
    page = HTTP.get(small_server + "/compare", params={"ref": refs}).text
    heads = re.findall(r'<th><a href="/versions/[^"]+">([^<]+)</a></th>', page)
    assert heads == ["acme/tiny/Q4_K_M@1", "acme/tiny/AWQ-W4-G128-asym@1", "acme/tiny/EXL2-4.0bpw@1"]
    kld_row = re.search(r'<tr data-key="kld">(.*?)</tr>', page, re.S)
    assert kld_row is not None and 'class="n best">2.500e-03' in kld_row.group(1)
    for bad in ([refs[0]], [refs[0]] * 3, [f"acme/tiny/V{i}" for i in range(7)]):
        r = HTTP.get(small_server + "/compare", params={"ref": bad})
        assert r.status_code == 400 and "compare needs 2 to 6" in r.text
    assert HTTP.get(small_server + "/compare", params={"ref": [refs[0], "acme/tiny/NOPE"]}).status_code == 404


def test_user_supplied_strings_are_escaped(small_server: str) -> None:
    for path in ("/versions/acme/tiny/Q2_K", "/models/acme/tiny", "/api"):
        page = HTTP.get(small_server + path).text
        assert "<script>alert" not in page, path
    page = HTTP.get(small_server + "/versions/acme/tiny/Q2_K").text
    assert "note=&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page  # lineage parameter
    assert "runner crashed &lt;script&gt;" in page  # the error text of the failed evaluation


@pytest.mark.parametrize("path", ["/", "/models/acme/tiny", "/versions/acme/tiny/Q8_0@1", "/models/nope", "/api",
                                  "/compare?ref=acme/tiny/Q8_0&ref=acme/tiny/F16"])
def test_pages_use_only_local_assets(small_server: str, path: str) -> None:
    r = HTTP.get(small_server + path)
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    for src in re.findall(r'(?:src|href)="([^"]+)"', r.text):
        assert src.startswith(("/", "#", "?")), src  # nothing from another origin (no CDN)
    assert "<script>" not in r.text  # no inline script: the CSP forbids it
    for asset in ("/static/app.js", "/static/style.css", "/static/favicon.svg"):
        assert HTTP.get(small_server + asset).status_code == 200


def test_cache_follows_every_write_and_revalidates(small_registry: Path) -> None:
    from registry import open_registry
    from tests.registry.web.server import serving

    reg = open_registry(str(small_registry), create=False)
    with serving(str(small_registry), token="t") as base:
        table = f"{base}/api/v1/models/acme/tiny/-/table"
        first = HTTP.get(table)
        etag = first.headers["etag"]
        assert etag.startswith('W/"') and HTTP.get(table).headers["etag"] == etag  # served from the cache
        assert HTTP.get(table, headers={"If-None-Match": etag}).status_code == 304
        page = HTTP.get(f"{base}/models/acme/tiny")
        assert HTTP.get(f"{base}/models/acme/tiny", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
        # A write through the API, then writes by another client straight into the registry.
        HTTP.put(f"{base}/api/v1/versions/acme/tiny/F16@1/-/aliases/edge", headers={"Authorization": "Bearer t"})
        assert {r["variant"]: r for r in HTTP.get(table).json()}["F16"]["aliases"] == {"edge": 1, "latest": 1}
        reg.add_result("acme/tiny/F16@1", {"kind": "quality", "engine": "llama.cpp", "status": "ok",
                                           "metrics": {"ppl": 10.5, "kld_mean": 0.25, "kld_method": "full-vocabulary"},
                                           "window_set_id": "ab" * 32})
        assert {r["variant"]: r for r in HTTP.get(table).json()}["F16"]["kld"] == 0.25
        assert ">2.500e-01</td>" in HTTP.get(f"{base}/models/acme/tiny").text
        reg.set_state("acme/tiny/F16@1", "rejected")
        assert 'class="state state-rejected">rejected' in HTTP.get(f"{base}/models/acme/tiny").text
        assert HTTP.get(table, headers={"If-None-Match": etag}).status_code == 200  # the old ETag is stale
