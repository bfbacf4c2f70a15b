"""The serving metric definitions on a hand-made request log: every number is computed by hand below.

The log (seconds; level start = 0):

* A: sent 0.00, chunks at 0.10 0.15 0.25 0.30; usage prompt 10, output 4 → TTFT 100, TPOT (0.30−0.10)/3 =
  66.67, gaps 50 100 50, E2EL 300 (ms);
* B: sent 0.05, chunks at 0.25 0.45; no usage (client count: 2 tokens; prompt: the client's 10) → TTFT 200,
  TPOT 200/1 = 200, gap 200, E2EL 400;
* C: sent 0.10, one chunk at 0.20; usage prompt 10, output 1 → TTFT 100, no TPOT, no gap, E2EL 100;
* D: sent 0.20, failed (timeout) after a first chunk at 0.50 → in ``failed``, in no latency.

Wall time: first send 0.00 → last token 0.45 (A's 0.30, B's 0.45, C's 0.20; D has no last token).
"""

from __future__ import annotations

import pytest

from evaluators.serving.metrics import (
    Level,
    Slo,
    attainment,
    find_knee,
    level_stats,
    meets_slo,
    percentiles_ms,
    tpot_s,
)
from pipeline.serving import LevelStats, RequestRecord

A = RequestRecord(t_sent=0.0, t_first=0.10, t_last=0.30, token_times=[0.10, 0.15, 0.25, 0.30], prompt_tokens=10,
                  output_tokens=4, output_tokens_client=4)
B = RequestRecord(t_sent=0.05, t_first=0.25, t_last=0.45, token_times=[0.25, 0.45], output_tokens_client=2)
C = RequestRecord(t_sent=0.10, t_first=0.20, t_last=0.20, token_times=[0.20], prompt_tokens=10, output_tokens=1,
                  output_tokens_client=1)
D = RequestRecord(t_sent=0.20, t_first=0.50, token_times=[0.50], error="timeout after 0.3 s")
LOG = [A, B, C, D]
CLOSED = Level(mode="concurrency", concurrency=4)


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-9, abs=1e-9)


@pytest.fixture(scope="module")
def stats() -> LevelStats:
    return level_stats(LOG, CLOSED, slo=Slo(ttft_ms=150, tpot_ms=100), prompt_tokens_client=10)


def test_counts_and_wall_time(stats: LevelStats) -> None:
    assert (stats.mode, stats.concurrency, stats.rate) == ("concurrency", 4, None)
    assert (stats.requests, stats.completed, stats.failed) == (4, 3, 1)
    assert stats.duration_s == approx(0.45)
    assert stats.requests_log == LOG


def test_ttft(stats: LevelStats) -> None:
    # [100, 200, 100] ms; sorted [100, 100, 200]: p90 at rank 1.8 → 100 + 0.8·100, p99 at 1.98 → 100 + 0.98·100
    assert stats.ttft_ms is not None
    assert stats.ttft_ms.model_dump() == {"mean": approx(400 / 3), "median": approx(100), "p90": approx(180),
                                          "p99": approx(198)}


def test_tpot_skips_the_one_token_request(stats: LevelStats) -> None:
    # A: 200/3 ms, B: 200 ms (its client count, 2), C: none (one token), D: failed
    assert tpot_s(C) is None
    assert stats.tpot_ms is not None
    lo, hi = 200 / 3, 200.0
    assert stats.tpot_ms.model_dump() == {"mean": approx((lo + hi) / 2), "median": approx((lo + hi) / 2),
                                          "p90": approx(lo + 0.9 * (hi - lo)), "p99": approx(lo + 0.99 * (hi - lo))}


def test_itl_pools_every_gap(stats: LevelStats) -> None:
    # gaps A 50 100 50, B 200 → sorted [50, 50, 100, 200]: median 75, p90 at rank 2.7 → 170, p99 at 2.97 → 197
    assert stats.itl_ms is not None
    assert stats.itl_ms.model_dump() == {"mean": approx(100), "median": approx(75), "p90": approx(170),
                                         "p99": approx(197)}


def test_e2el(stats: LevelStats) -> None:
    # [300, 400, 100] → sorted [100, 300, 400]: p90 at 1.8 → 380, p99 at 1.98 → 398
    assert stats.e2el_ms is not None
    assert stats.e2el_ms.model_dump() == {"mean": approx(800 / 3), "median": approx(300), "p90": approx(380),
                                          "p99": approx(398)}


def test_throughputs(stats: LevelStats) -> None:
    # 3 completed, output 4 + 2 + 1 = 7 (B's from the client), prompt 10 + 10 + 10 (B's the client's)
    assert stats.request_throughput == approx(3 / 0.45)
    assert stats.output_throughput == approx(7 / 0.45)
    assert stats.total_token_throughput == approx(37 / 0.45)


def test_goodput(stats: LevelStats) -> None:
    # TTFT ≤ 150 and TPOT ≤ 100: A yes (100, 66.7), B no (TTFT 200), C yes (100, no TPOT), D failed
    slo = Slo(ttft_ms=150, tpot_ms=100)
    assert [meets_slo(r, slo) for r in LOG] == [True, False, True, False]
    assert stats.request_goodput == approx(2 / 0.45)
    assert attainment(stats, slo) == approx(0.5)
    # the TPOT bound alone: A (66.7) passes, B (200) fails, C passes (no TPOT)
    assert [meets_slo(r, Slo(tpot_ms=100)) for r in LOG] == [True, False, True, False]


def test_no_slo_no_goodput_and_missing_counts_give_none() -> None:
    stats = level_stats(LOG, CLOSED)  # no SLO, and B has no prompt count at all
    assert stats.request_goodput is None
    assert stats.total_token_throughput is None
    assert stats.output_throughput == approx(7 / 0.45)


def test_all_failed_level() -> None:
    stats = level_stats([D], Level(mode="poisson", rate=2.0), slo=Slo(ttft_ms=1000))
    assert (stats.requests, stats.completed, stats.failed, stats.duration_s) == (1, 0, 1, 0.0)
    assert stats.ttft_ms is None and stats.request_throughput is None and stats.request_goodput is None
    assert percentiles_ms([]) is None


def _poisson(rate: float, good: int, bad: int) -> LevelStats:
    fast = RequestRecord(t_sent=0.0, t_first=0.1, t_last=0.2, token_times=[0.1, 0.2], output_tokens=2)
    slow = RequestRecord(t_sent=0.0, t_first=2.0, t_last=2.1, token_times=[2.0, 2.1], output_tokens=2)
    return level_stats([fast] * good + [slow] * bad, Level(mode="poisson", rate=rate))


def test_knee_is_the_last_rate_meeting_the_slo() -> None:
    slo = Slo(ttft_ms=1000, tpot_ms=200)
    levels = [_poisson(4.0, 5, 5), _poisson(1.0, 10, 0), _poisson(2.0, 9, 1), _poisson(8.0, 0, 10)]
    knee = find_knee(levels, slo)
    assert knee is not None
    assert (knee["met_rate"], knee["failed_rate"]) == (2.0, 4.0)
    assert knee["attainment"] == {"1": 1.0, "2": 0.9, "4": 0.5, "8": 0.0}
    none_met = find_knee([_poisson(1.0, 1, 9)], slo)
    assert none_met is not None and (none_met["met_rate"], none_met["failed_rate"]) == (None, 1.0)
    assert find_knee([level_stats(LOG, CLOSED)], slo) is None
