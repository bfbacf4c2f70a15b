"""Load generation against a real llama-server (Quantyard's launcher) on the demo's Q4_K_M GGUF: every request
completes with the asked shape (usage: exactly the output tokens asked, the prompt about the asked length),
one streamed chunk per token, the server's memory peak recorded per level, and the closed loop's shape: one
request in flight at 1 user, several (at most 4) at 4 users.

Speeds are not compared across levels: the demo model (5 M parameters) decodes a token in well under a
millisecond, so per-request HTTP and client work dominate and 4 users measured no more output per second than
1 here (782 vs 669 tok/s in one run); chunks also reach the client in bursts (gaps of ~20 µs between tokens
read together). The real checkpoint's numbers are in bench/results/serving.txt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from evaluators.serving.load import TOOL, run_load
from evaluators.serving.server import start_server
from evaluators.serving.spec import ServerSpec
from pipeline.config import Settings
from pipeline.serving import LevelStats, LoadProfile
from pipeline.specs import Engine
from registry import open_registry

pytestmark = pytest.mark.slow

PROMPT, OUTPUT = 32, 16


@pytest.fixture(scope="module")
def gguf(demo_registry_template: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    reg = open_registry(str(demo_registry_template["registry"]))
    (path,) = reg.link_files("demo/Q4_K_M", tmp_path_factory.mktemp("served"))
    return path


def test_closed_loop_on_llama_server(gguf: Path, demo_model: Path, tmp_path: Path, cache_dir: Path) -> None:
    settings = Settings(cache_dir=cache_dir, work_dir=tmp_path / "work", threads=2)
    profile = LoadProfile(name="custom", tool=TOOL, prompt_tokens=PROMPT, output_tokens=OUTPUT, concurrencies=[1, 4],
                          requests_per_level=8, warmup_requests=2, timeout_s=60.0, slo_ttft_ms=1000.0,
                          slo_itl_ms=100.0)
    spec = ServerSpec(engine=Engine.LLAMA_CPP, model=gguf, slots=4, context=128, start_timeout_s=180)
    with start_server(spec, settings, tmp_path / "logs") as srv:
        levels = run_load(srv.base_url, srv.model_name, demo_model, profile, settings, tmp_path / "load", sampler=srv)
        weights = srv.weights_bytes
    assert [lv.concurrency for lv in levels] == [1, 4]
    for lv in levels:
        assert (lv.requests, lv.completed, lv.failed) == (8, 8, 0), [r.error for r in lv.requests_log]
        for rec in lv.requests_log:
            assert rec.output_tokens == OUTPUT  # ignore_eos and max_tokens honoured, usage streamed
            assert rec.prompt_tokens is not None and PROMPT <= rec.prompt_tokens <= PROMPT + 2  # + BOS, re-split
            assert len(rec.token_times) == OUTPUT  # one chunk per token: ITL gaps are per token here
        assert lv.ttft_ms is not None and lv.tpot_ms is not None and lv.itl_ms is not None
        assert lv.rss_peak_bytes is not None and lv.rss_peak_bytes > weights
    assert _most_in_flight(levels[0]) == 1
    assert 2 <= _most_in_flight(levels[1]) <= 4


def _most_in_flight(lv: LevelStats) -> int:
    """The most measured requests between their send and their last token at one time."""
    events = sorted([(r.t_sent, 1) for r in lv.requests_log] + [(r.t_last or r.t_sent, -1) for r in lv.requests_log])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most
