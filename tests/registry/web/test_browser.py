"""The demo registry in a real headless Chromium (Debian's package), driven by Playwright: open the model
page, sort by KLD, open a variant, download a file and check its sha256, screenshot the model page."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.registry.web.server import serving

CHROMIUM = os.environ.get("QUANTYARD_CHROMIUM", "/usr/bin/chromium")
# As root in a container, without a sandbox; no background traffic to hosts this machine cannot reach.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--disable-extensions"]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the browser test: `make setup` installs it)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        _unavailable(f"Chromium is not installed at {CHROMIUM}: run `make setup` (Debian package chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed: run `make setup`")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_model_page_sort_open_download(browser: Any, demo_registry: Path, tmp_path: Path,
                                       artifacts_dir: Path) -> None:
    problems: list[str] = []
    with serving(str(demo_registry)) as base:
        context = browser.new_context(accept_downloads=True, viewport={"width": 1500, "height": 900})
        page = context.new_page()
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("dialog", lambda d: problems.append(f"dialog: {d.message}"))

        # 1. the model page of the demo registry, reached from the index
        page.goto(base + "/")
        page.get_by_role("link", name="demo", exact=True).click()
        page.wait_for_url(base + "/models/demo")
        rows = page.locator("#variants tbody tr[data-ref]")
        assert rows.count() == 4
        variants = rows.locator("a.variant-link").all_inner_texts()
        assert sorted(variants) == ["F16", "Q2_K", "Q4_K_M", "Q8_0"]
        assert page.locator("#chart circle.marker").count() == 4
        assert page.locator("#chart polyline.front").count() == 1
        # the noise floor, drawn as a line, and F16 (the unquantized model on llama.cpp) marked within it
        assert page.locator("#chart #noise-floor line.floor").count() == 1  # a horizontal line: no height to "see"
        assert page.locator("#chart #noise-floor text.floor-label").is_visible()
        assert "noise floor: KLD" in page.locator("#legend-floor").inner_text()
        f16 = page.locator('#variants tr[data-ref="demo/F16@1"] td.m-kld').inner_text()
        q2 = page.locator('#variants tr[data-ref="demo/Q2_K@1"] td.m-kld').inner_text()
        assert f16.endswith("≃") and not q2.endswith("≃"), (f16, q2)

        # 2. sort by KLD (client-side): ascending, then descending
        page.locator("#variants th[data-key=kld] a.sort").click()
        assert page.locator("#variants th[data-key=kld]").get_attribute("aria-sort") == "ascending"
        klds = [float(v) for v in rows.locator("td.m-kld").evaluate_all("cells => cells.map(c => c.dataset.v)")]
        assert klds == sorted(klds) and len(klds) == 4
        by_kld = rows.locator("a.variant-link").all_inner_texts()
        assert by_kld[0] == "F16" and by_kld[-1] == "Q2_K"  # more bits, less divergence
        assert "sort=kld" in page.url
        page.locator("#variants th[data-key=kld] a.sort").click()
        klds_desc = [float(v) for v in rows.locator("td.m-kld").evaluate_all("cells => cells.map(c => c.dataset.v)")]
        assert klds_desc == sorted(klds, reverse=True)
        page.locator("#variants th[data-key=kld] a.sort").click()  # back to ascending for the screenshot

        # 5. a screenshot of the model page, kept as a test artifact (and used in the README)
        shot = artifacts_dir / "model-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000

        # 3. open a variant and download a file
        page.locator("#variants a.variant-link", has_text="Q4_K_M").click()
        page.wait_for_url(base + "/versions/demo/Q4_K_M@1")
        assert page.locator("#version-ref").inner_text().startswith("demo/Q4_K_M")
        link = page.locator("#files a.download").first
        name = link.inner_text()
        listed_sha = page.locator(f'#files code.sha[data-file="{name}"]').inner_text()
        listed_size = int(page.locator("#files td[data-bytes]").first.get_attribute("data-bytes"))
        with page.expect_download() as info:
            link.click()
        download = info.value
        assert download.failure() is None
        saved = tmp_path / "download" / download.suggested_filename
        download.save_as(saved)

        # 4. the bytes hash to the listed sha256
        assert download.suggested_filename == name == "demo-Q4_K_M.gguf"
        assert saved.stat().st_size == listed_size
        assert sha256_file(saved) == listed_sha
        assert page.locator("pre code", has_text="quantyard pull demo/Q4_K_M@1").count() == 1
        assert page.locator("pre code", has_text="llama-server -m").count() == 1

        # and the compare page from two ticked rows
        page.go_back()
        page.locator('input[name=ref][value="demo/Q4_K_M@1"]').check()
        page.locator('input[name=ref][value="demo/Q8_0@1"]').check()
        page.locator("#compare-button").click()
        page.wait_for_url("**/compare?**")
        assert page.locator("#compare thead th a").all_inner_texts() == ["demo/Q8_0@1", "demo/Q4_K_M@1"] or \
            sorted(page.locator("#compare thead th a").all_inner_texts()) == ["demo/Q4_K_M@1", "demo/Q8_0@1"]
        context.close()
    assert problems == [], problems


def test_stand_in_and_exact_rows_look_different(browser: Any, tmp_path: Path, artifacts_dir: Path) -> None:
    """On the model page of tests/labelled.py's registry, the exl2-reference stand-in row and an exact,
    engine-measured row render differently (hatching, italics, a badge, a marked engine, a legend line), a KLD
    bound shows as ≥…†, and the chart draws stand-ins as diamonds; screenshots go to test-artifacts/."""
    from tests.labelled import build_labelled_registry

    registry = build_labelled_registry(tmp_path / "registry", tmp_path / "files")
    problems: list[str] = []
    with serving(str(registry)) as base:
        page = browser.new_page(viewport={"width": 1750, "height": 900})  # wide enough for the engine column
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.goto(base + "/models/acme/labels")
        exact = page.locator('#variants tr[data-ref="acme/labels/Q8_0@1"]')
        stand_in = page.locator('#variants tr[data-ref="acme/labels/EXL2-4.0bpw-ref@1"]')

        def style(row: Any, prop: str) -> str:
            return str(row.locator("td.m-kld").evaluate(f"c => getComputedStyle(c).{prop}"))

        assert style(exact, "backgroundImage") == "none"
        assert "repeating-linear-gradient" in style(stand_in, "backgroundImage")
        assert (style(exact, "fontStyle"), style(stand_in, "fontStyle")) == ("normal", "italic")
        assert stand_in.locator(".badge.stand-in").is_visible() and exact.locator(".badge").count() == 0
        assert stand_in.locator("span.mark").inner_text() == "*" and exact.locator("span.mark").count() == 0
        bound = page.locator('#variants tr[data-ref="acme/labels/Q4_K_M@1"] td.m-kld')
        assert bound.inner_text() == "≥4.081e-02†" and exact.locator("td.m-kld").inner_text() == "1.235e-06"
        assert bound.evaluate("c => getComputedStyle(c).color") != style(exact, "color")
        legend = page.locator('#marks li[data-mark="stand-in:exl2:exl2-reference"]')
        assert legend.is_visible() and "not ExLlamaV2's kernels" in legend.inner_text()
        diamonds = page.locator("#chart path.marker.stand-in")
        assert diamonds.count() == 2 and diamonds.first.is_visible()
        hollow = page.locator('#chart circle.marker.hollow[data-ref="acme/labels/Q4_K_M@1"]')  # a KLD bound
        assert hollow.evaluate("c => getComputedStyle(c).stroke") == "rgb(31, 119, 180)"  # its format's colour
        assert hollow.evaluate("c => getComputedStyle(c).fill") == "rgb(255, 255, 255)"
        shot = artifacts_dir / "stand-in-labels.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        stand_in.screenshot(path=str(artifacts_dir / "stand-in-row.png"))
        exact.screenshot(path=str(artifacts_dir / "exact-row.png"))
        page.close()
    assert problems == [], problems


def test_serving_charts_render(browser: Any, tmp_path: Path, artifacts_dir: Path) -> None:
    """On the model page of tests/labelled_serving.py's registry (SYNTHETIC numbers), the serving section draws
    both charts with one visible line per variant and engine and a legend, the memory column says what fits, and
    the CPU-scaled, replaced-kernel AWQ line carries its marks; screenshots go to test-artifacts/ (serving-chart.png
    is the one kept as docs/serving-chart.png)."""
    from tests.labelled_serving import MODEL, build_serving_registry

    registry = build_serving_registry(tmp_path / "registry", tmp_path / "files")
    problems: list[str] = []
    with serving(str(registry)) as base:
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.goto(f"{base}/models/{MODEL}")
        for chart in ("#serving-ttft", "#serving-throughput"):
            lines = page.locator(f"{chart} polyline.line")
            assert lines.count() == 9 and lines.first.is_visible()  # every served variant; EXL2 was not served
            assert page.locator(f"{chart} g.series").count() == 9
            assert page.locator(f"{chart} figcaption .legend").count() == 9
            assert page.locator(f"{chart} polyline.line").first.evaluate("l => getComputedStyle(l).fill") == "none"
        awq = page.locator('#serving-ttft figcaption .legend[data-ref="acme/serving/AWQ-W4-G128-asym@1"]')
        assert awq.inner_text().strip().endswith("¶§")
        memory = page.locator('#variants tr[data-ref="acme/serving/Q4_K_M@1"] td.memory')
        assert memory.inner_text() == "fits in 5.20 GB at context 8,192 with 64 users" and memory.is_visible()
        page.screenshot(path=str(artifacts_dir / "serving-page.png"), full_page=True)
        page.set_viewport_size({"width": 900, "height": 900})  # the section's text wraps at the charts' width
        top = page.locator("#serving h2").bounding_box()
        end = page.locator("#serving p.serving-note").last.bounding_box()  # it says the numbers are SYNTHETIC
        assert top is not None and end is not None
        assert "SYNTHETIC" in page.locator("#serving p.serving-note").last.inner_text()
        shot = artifacts_dir / "serving-chart.png"
        page.screenshot(path=str(shot), full_page=True, clip={"x": 0, "y": top["y"] - 8, "width": 900,
                                                             "height": end["y"] + end["height"] - top["y"] + 16})
        assert 10_000 < shot.stat().st_size < 500_000
        page.close()
    assert problems == [], problems
