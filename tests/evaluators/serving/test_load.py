"""Load generation through GuideLLM, end to end, against servers whose latencies are known.

* ``guidellm mock-server`` (shipped with GuideLLM, run from the ``guidellm`` environment) with a set TTFT and
  ITL: a closed loop at 1 and 4 users must measure them (the mock sleeps exactly those times; what the
  measurement adds is HTTP and scheduling overhead on this machine, hence a one-sided tolerance);
* a single-threaded fake server below (one request at a time, others queue in the socket backlog): an
  open-loop sweep must find its knee, a rate it serves within the SLO and a rate above its capacity at
  which requests queue past the TTFT bound, instead of timing out.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from evaluators.serving.load import (
    EARLY_S,
    TOOL,
    check_paced,
    requests_sent,
    run_load,
    sweep_profile,
    tail_requests,
    to_records,
)
from evaluators.serving.metrics import Level, Slo, find_knee
from pipeline import envs
from pipeline.config import Settings
from pipeline.errors import EngineError
from pipeline.serving import LevelStats, LoadProfile, RequestRecord

pytestmark = pytest.mark.slow

MOCK_TTFT_MS, MOCK_ITL_MS = 150.0, 20.0
#: What a measurement may add to the mock's set latencies (ms): HTTP, sanic and asyncio scheduling on a
#: shared 2-core machine (measured here: +8 to +15 ms TTFT, +1 ms ITL at the median). A TTFT or TPOT below the
#: set one is a bug (the mock cannot answer faster than it sleeps); one gap may look shorter by the arrival
#: jitter of its two chunks, hence JITTER_MS below the set ITL for the pooled gaps' median.
TTFT_SLACK_MS, ITL_SLACK_MS, JITTER_MS = 100.0, 10.0, 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_up(url: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2):
            return
        time.sleep(0.5)
    raise TimeoutError(f"nothing answered at {url} within {timeout_s} s")


@pytest.fixture(scope="module")
def guidellm_settings(cache_dir: Path) -> Settings:
    return Settings(cache_dir=cache_dir)


@pytest.fixture(scope="module")
def mock_server(guidellm_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``guidellm mock-server`` on loopback (no ``--processor``: it crashes with a local one under transformers 5)."""
    python, port = envs.python_for("guidellm", guidellm_settings), _free_port()
    log = tmp_path_factory.mktemp("mock") / "mock-server.log"
    cmd = [python, "-m", "guidellm", "mock-server", "--host", "127.0.0.1", "--port", str(port), "--model", "mock",
           "--ttft-ms", str(MOCK_TTFT_MS), "--itl-ms", str(MOCK_ITL_MS)]
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_up(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _profile(**kw: object) -> LoadProfile:
    base: dict[str, object] = {"name": "custom", "tool": TOOL, "prompt_tokens": 32, "output_tokens": 16,
                               "concurrencies": [1, 4], "requests_per_level": 8, "warmup_requests": 1,
                               "timeout_s": 30.0, "slo_ttft_ms": 1000.0, "slo_itl_ms": 100.0}
    return LoadProfile.model_validate({**base, **kw})


def test_closed_loop_measures_the_mock_servers_latencies(mock_server: str, demo_model: Path, tmp_path: Path,
                                                         guidellm_settings: Settings) -> None:
    seen: list[LevelStats] = []
    levels = run_load(mock_server, "mock", demo_model, _profile(), guidellm_settings, tmp_path, on_level=seen.append)
    assert [lv.concurrency for lv in levels] == [1, 4] and seen == levels
    for lv in levels:
        assert (lv.requests, lv.completed, lv.failed) == (8, 8, 0), lv.requests_log
        assert lv.ttft_ms is not None and lv.itl_ms is not None and lv.tpot_ms is not None
        assert MOCK_TTFT_MS <= lv.ttft_ms.median <= MOCK_TTFT_MS + TTFT_SLACK_MS, lv.ttft_ms
        assert MOCK_ITL_MS - JITTER_MS <= lv.itl_ms.median <= MOCK_ITL_MS + ITL_SLACK_MS, lv.itl_ms
        assert MOCK_ITL_MS <= lv.tpot_ms.median <= MOCK_ITL_MS + ITL_SLACK_MS, lv.tpot_ms
        for rec in lv.requests_log:
            # the mock streams one token per chunk and reports usage: 16 chunks, 15 gaps, usage = 16
            assert rec.output_tokens == 16 and len(rec.token_times) == 16
            assert rec.t_first == pytest.approx(rec.token_times[0], abs=2e-3)
            assert rec.output_tokens_client is not None and rec.output_tokens_client > 0
        assert lv.output_throughput == pytest.approx(16 * lv.completed / lv.duration_s)
    # 4 users overlap: more requests per second than one user, at (about) the same per-request latency
    one, four = levels[0].request_throughput, levels[1].request_throughput
    assert one is not None and four is not None and four > 2 * one
    report = json.loads((tmp_path / "01-c1" / "guidellm-report.json").read_text())
    # warm-up + measured + the 1-user tail were sent (GuideLLM may leave the last, in flight, out of its report)
    assert len(report["benchmarks"][0]["requests"]["successful"]) in (9, 10)
    assert report["benchmarks"][0]["scheduler_state"]["created_requests"] == 10


def test_warmup_requests_are_the_first_sent() -> None:
    entries = [{"status": "successful", "request_start": t, "first_token": t + 0.1, "last_token": t + 0.2,
                "token_times": [t + 0.1, t + 0.2], "usage": {"prompt_tokens": 5, "completion_tokens": 2},
                "output_tokens_client": 2, "error": None} for t in (103.0, 101.0, 102.0)]
    entries.append({"status": "errored", "request_start": 104.0, "first_token": None, "last_token": None,
                    "token_times": [], "usage": None, "output_tokens_client": None, "error": "ReadTimeout()"})
    records = to_records(entries, warmup=1)
    assert [r.t_sent for r in records] == [0.0, 1.0, 2.0]  # 101 was warm-up; times from the first measured send
    assert records[0].token_times == [pytest.approx(0.1), pytest.approx(0.2)]
    assert records[-1].error == "ReadTimeout()" and records[-1].output_tokens is None


def test_the_tail_after_the_measured_requests_is_not_measured() -> None:
    """A closed loop sends one more request per user after the measured ones: they run as users stop, and the
    last may be missing from GuideLLM's report; the measured requests are the ones between warm-up and tail."""
    assert tail_requests(Level(mode="concurrency", concurrency=4)) == 4
    assert tail_requests(Level(mode="poisson", rate=2.0)) == 0
    assert requests_sent(_profile(), Level(mode="concurrency", concurrency=4)) == 1 + 8 + 4
    entries = [{"status": "successful", "request_start": float(t), "first_token": t + 0.1, "last_token": t + 0.2,
                "token_times": [t + 0.1, t + 0.2], "usage": {"prompt_tokens": 5, "completion_tokens": 2},
                "output_tokens_client": 2, "error": None} for t in range(6)]
    records = to_records(entries, warmup=1, measured_n=3)
    assert [r.t_sent for r in records] == [0.0, 1.0, 2.0]  # sent at 1, 2, 3: 0 was warm-up, 4 and 5 the tail
    assert len(to_records(entries[:4], warmup=1, measured_n=3)) == 3  # the tail left out of the report
    # an open loop keeps each request's scheduled arrival, on the same clock; a closed loop has none to keep
    scheduled = [{**e, "targeted_start": e["request_start"] - 0.005} for e in entries]
    assert [r.t_target for r in to_records(scheduled, warmup=1, measured_n=3, open_loop=True)] == \
        [pytest.approx(t - 0.005) for t in (0.0, 1.0, 2.0)]
    assert {r.t_target for r in to_records(scheduled, warmup=1, measured_n=3)} == {None}


def test_a_poisson_level_sent_in_a_burst_is_an_error(tmp_path: Path) -> None:
    """GuideLLM counts Poisson arrivals from its planned start: workers that start late send every due request
    at once. Such a level is not the asked load and fails; a paced one passes, and a closed loop is not checked."""
    def records(gaps: float) -> list[RequestRecord]:
        return [RequestRecord(t_sent=i * gaps, t_first=i * gaps + 0.05, t_last=i * gaps + 0.1, token_times=[],
                              prompt_tokens=4, output_tokens=4, output_tokens_client=4) for i in range(16)]

    poisson = Level(mode="poisson", rate=2.0)
    with pytest.raises(EngineError, match=r"sent 16 requests in 0\.037 s at a Poisson rate of 2/s"):
        check_paced(records(0.0025), poisson, tmp_path)
    check_paced(records(0.5), poisson, tmp_path)
    check_paced(records(0.0025), Level(mode="concurrency", concurrency=4), tmp_path)
    # a burst over part of a level: the span looks paced, but some requests left before their scheduled arrival
    paced = [r.model_copy(update={"t_target": r.t_sent - 0.004}) for r in records(0.5)]
    check_paced(paced, poisson, tmp_path)
    partial = [r.model_copy(update={"t_target": r.t_sent + (1.2 - 0.1 * i if i < 6 else -0.004)})
               for i, r in enumerate(records(0.5))]
    with pytest.raises(EngineError, match=r"sent 6 of 16 requests before their scheduled Poisson arrival at 2/s "
                                          r"\(up to 1\.200 s early\)"):
        check_paced(partial, poisson, tmp_path)


def _records(gaps: float) -> list[RequestRecord]:
    return [RequestRecord(t_sent=i * gaps, t_first=i * gaps + 0.05, t_last=i * gaps + 0.1, token_times=[],
                          prompt_tokens=4, output_tokens=4, output_tokens_client=4) for i in range(16)]


@pytest.mark.parametrize("bursts", [0, 1, 2])
def test_a_burst_level_is_run_again_once(bursts: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GuideLLM now and then sends a Poisson level at once (seen in a full test run: 16 requests in 0.019 s at
    60/s): the level runs again, the burst's files kept as <level>.burst1, and the level says it took two runs;
    a second burst is the error. Only GuideLLM's run is replaced here (by one that writes files and returns the
    send times of a burst or of a paced level); what is tested is what run_level does with them."""
    import evaluators.serving.load as load

    runs: list[int] = []

    def once(python: str, target: object, profile: object, level: Level, level_dir: Path, settings: object,
             seed: int) -> list[RequestRecord]:
        level_dir.mkdir(parents=True)
        (level_dir / "requests.json").write_text(json.dumps({"run": len(runs) + 1}))
        runs.append(1)
        return _records(0.0025 if len(runs) <= bursts else 0.5)

    monkeypatch.setattr(load, "_run_level_once", once)
    level_dir = tmp_path / "02-r60"

    def call() -> tuple[list[RequestRecord], int]:
        return load.run_level("py", None, None, Level(mode="poisson", rate=2.0), level_dir, None)  # type: ignore[arg-type]

    if bursts >= load.PACING_ATTEMPTS:
        with pytest.raises(EngineError, match="not paced"):
            call()
        assert len(runs) == load.PACING_ATTEMPTS
        return
    records, attempts = call()
    assert attempts == bursts + 1 == len(runs) and records == _records(0.5)
    assert json.loads((level_dir / "requests.json").read_text()) == {"run": attempts}
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("02-r60.burst"))
    assert kept == [f"02-r60.burst{i}" for i in range(1, bursts + 1)]


def test_no_server_is_a_clear_error(guidellm_settings: Settings, demo_model: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no OpenAI-compatible server"):
        run_load(f"http://127.0.0.1:{_free_port()}", "x", demo_model, _profile(), guidellm_settings, tmp_path)


# --- a server that saturates: one request at a time --------------------------------------------------------

QUEUE_TTFT_S, QUEUE_ITL_S, QUEUE_TOKENS = 0.1, 0.01, 4


class _OneAtATime(BaseHTTPRequestHandler):
    """``/v1/completions`` streamed with a fixed TTFT and ITL; HTTP/1.0, so each connection is one request."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._send(200, "application/json", json.dumps({"object": "list", "data": [{"id": "queue"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(QUEUE_TTFT_S)
        n = min(int(body.get("max_tokens") or QUEUE_TOKENS), QUEUE_TOKENS)
        for i in range(n):
            if i:
                time.sleep(QUEUE_ITL_S)
            self._event({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
        self._event({"choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, data: dict[str, object]) -> None:
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _send(self, code: int, kind: str, payload: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _Serial(socketserver.TCPServer):
    request_queue_size = 256
    allow_reuse_address = True


@pytest.fixture
def queue_server() -> Iterator[str]:
    server = _Serial(("127.0.0.1", 0), _OneAtATime)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_open_loop_sweep_finds_the_knee_of_a_saturating_server(queue_server: str, demo_model: Path,
                                                                 tmp_path: Path, guidellm_settings: Settings) -> None:
    # one request takes ~0.13 s (TTFT 100 ms + 3 gaps of 10 ms): capacity ~7 requests/s. At 1.5/s a request
    # misses the 1 s TTFT bound only behind ~7 others (or in a stall of the machine near a second); at 100/s
    # 16 requests arrive within ~0.16 s and the 8th and later queue for over a second: half of them miss it.
    slo = Slo(ttft_ms=1000.0, tpot_ms=100.0)
    profile = sweep_profile([1.5, 100.0, 200.0], shape=_profile(output_tokens=QUEUE_TOKENS, warmup_requests=0,
                                                                  requests_per_level=16), slo=slo)
    levels = run_load(queue_server, "queue", demo_model, profile, guidellm_settings, tmp_path)
    assert [lv.rate for lv in levels] == [1.5, 100.0]  # the sweep stops at the first rate that misses the SLO
    knee = find_knee(levels, slo)
    assert knee is not None and (knee["met_rate"], knee["failed_rate"]) == (1.5, 100.0), knee
    low, high = levels
    assert low.ttft_ms is not None and high.ttft_ms is not None
    assert low.ttft_ms.median < 1000.0 < high.ttft_ms.p90  # queueing, measured
    assert high.failed == 0  # a knee, not timeouts
    for lv in levels:  # each request's scheduled arrival is kept, and none went out before it (check_paced)
        assert all(r.t_target is not None and r.t_sent >= r.t_target - EARLY_S for r in lv.requests_log)
        assert lv.dispatch_delay_ms is not None and lv.dispatch_delay_ms.median >= 0.0, lv.dispatch_delay_ms
