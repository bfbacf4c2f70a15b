"""Serving metrics: one definition each, with ``vllm bench serve``'s names, from raw per-request records.

Input: the :class:`~pipeline.serving.RequestRecord` of every *measured* request of one load level (warm-up
requests are dropped before, by the load generator's driver). Times are seconds on one client clock; only
differences are used. Output: one :class:`~pipeline.serving.LevelStats`.

A request **completed** when it has no ``error`` and received at least one content token (``t_first`` and
``t_last`` set); every other measured request is **failed** (HTTP error, timeout, cut stream, or a stream
without a token, which vLLM's client also counts as a failure). Latencies use completed requests only.

Per request (completed):

* ``ttft``: time to first token, ``t_first − t_sent``;
* ``tpot``: time per output token after the first, ``(t_last − t_first) / (n_out − 1)``; only for
  ``n_out ≥ 2`` (a one-token request has none). GuideLLM reports this same number as "ITL";
* ``itl``: every gap between consecutive streamed chunks, ``token_times[i+1] − token_times[i]``, pooled over
  all completed requests (vLLM's ITL). A chunk normally carries one token; where a server sends several per
  chunk the gap is per chunk, as in vLLM. A request without ``token_times`` contributes no gap;
* ``e2el``: end-to-end latency, ``t_last − t_sent``.

Per request (open loop, every measured one): ``dispatch delay``, ``t_sent − t_target``, how late the client
sent it after its scheduled Poisson arrival (GuideLLM's ``request_dispatch_delay``). The latencies above
start at ``t_sent``, as vLLM's do; a client that falls behind its schedule offers a burstier load than its
rate, which this shows.

Each latency is reported in **milliseconds** as mean, median, p90 and p99 (numpy's default linear
interpolation between order statistics, as ``vllm bench serve`` computes them); ``None`` when no request has
a value (for example every request produced one token: no TPOT, no ITL).

Token counts (``n_out``, prompt tokens): the server's ``usage`` is preferred. When a completed request's
usage lacks the output count, the client's tokenizer count of the received text
(``output_tokens_client``) is used; when it lacks the prompt count, ``prompt_tokens_client`` (the prompt
length the client generated with the same tokenizer). Both counts stay in ``requests_log``, so which one
was used is visible per request (``output_tokens is None`` means the client count was used). A completed
request with neither count gets no TPOT, and makes the throughput it would enter ``None`` rather than an
undercount.

Per level, over its **wall time** ``duration_s`` = first ``t_sent`` → last token received by any measured
request (``max t_last``):

* ``request_throughput`` = completed / duration (requests/s);
* ``output_throughput`` = Σ n_out over completed / duration (tokens/s);
* ``total_token_throughput`` = Σ (prompt + n_out) over completed / duration (tokens/s);
* ``request_goodput`` = completed requests meeting the SLO / duration (requests/s), with the SLO
  ``ttft ≤ slo.ttft_ms`` and ``tpot ≤ slo.tpot_ms``. **The "ITL" bound of an SLO
  (``LoadProfile.slo_itl_ms``) applies to the per-request TPOT**, as in ``vllm bench serve --goodput``, whose
  keys are ``ttft``, ``tpot`` and ``e2el``: a single slow gap does not fail a request, a slow mean does. A
  one-token request has no TPOT and passes that bound (vLLM counts its TPOT as 0);
* ``failed`` = measured requests − completed.

The **knee** of an open-loop sweep (:func:`find_knee`): a level *meets the SLO* when at least
:data:`SLO_ATTAINMENT` of its measured requests (failed ones included in the denominator) completed within the
SLO; the knee is the highest rate that met it and the first higher rate that did not.

Everything here is computed from the records; nothing is estimated.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipeline.serving import LevelStats, Percentiles, RequestRecord

#: A level meets the SLO when at least this fraction of its measured requests completed within it.
SLO_ATTAINMENT = 0.9


@dataclass(frozen=True)
class Slo:
    """A goodput objective, in milliseconds; ``None`` leaves that latency unbounded.

    ``tpot_ms`` bounds the per-request TPOT (what ``LoadProfile.slo_itl_ms`` means, see the module docstring).
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def describe(self) -> str:
        parts = [f"TTFT ≤ {self.ttft_ms:g} ms" if self.ttft_ms is not None else "",
                 f"TPOT ≤ {self.tpot_ms:g} ms" if self.tpot_ms is not None else ""]
        return " and ".join(p for p in parts if p) or "none"


@dataclass(frozen=True)
class Level:
    """Which load level the records belong to: ``concurrency`` users (closed loop) or ``rate`` req/s (Poisson)."""

    mode: Literal["concurrency", "poisson"]
    concurrency: int | None = None
    rate: float | None = None


# --- per request --------------------------------------------------------------------------------------------


def completed(rec: RequestRecord) -> bool:
    """Did the request finish without error and receive at least one content token?"""
    return rec.error is None and rec.t_first is not None and rec.t_last is not None


def output_tokens(rec: RequestRecord) -> int | None:
    """The request's output token count: the server's usage, else the client's tokenizer count."""
    return rec.output_tokens if rec.output_tokens is not None else rec.output_tokens_client


def prompt_tokens(rec: RequestRecord, client: int | None = None) -> int | None:
    """The request's prompt token count: the server's usage, else ``client`` (the generated prompt's length)."""
    return rec.prompt_tokens if rec.prompt_tokens is not None else client


def ttft_s(rec: RequestRecord) -> float | None:
    """Time to first token, seconds (None unless completed)."""
    return rec.t_first - rec.t_sent if completed(rec) and rec.t_first is not None else None


def tpot_s(rec: RequestRecord) -> float | None:
    """Time per output token after the first, seconds: ``(t_last − t_first) / (n_out − 1)``; None below 2 tokens."""
    n = output_tokens(rec)
    if not completed(rec) or n is None or n < 2 or rec.t_first is None or rec.t_last is None:
        return None
    return (rec.t_last - rec.t_first) / (n - 1)


def e2el_s(rec: RequestRecord) -> float | None:
    """End-to-end latency, seconds: request sent → last token (None unless completed)."""
    return rec.t_last - rec.t_sent if completed(rec) and rec.t_last is not None else None


def itl_gaps_s(rec: RequestRecord) -> list[float]:
    """Every gap between consecutive streamed chunks of a completed request, seconds."""
    if not completed(rec):
        return []
    times = rec.token_times
    return [b - a for a, b in itertools.pairwise(times)]


def meets_slo(rec: RequestRecord, slo: Slo) -> bool:
    """Did the request complete within the SLO? (A request without TPOT passes the TPOT bound, as in vLLM.)"""
    if not completed(rec):
        return False
    ttft, tpot = ttft_s(rec), tpot_s(rec)
    if slo.ttft_ms is not None and (ttft is None or 1000 * ttft > slo.ttft_ms):
        return False
    return not (slo.tpot_ms is not None and tpot is not None and 1000 * tpot > slo.tpot_ms)


# --- per level ----------------------------------------------------------------------------------------------


def percentiles_ms(values_s: Sequence[float]) -> Percentiles | None:
    """Mean, median, p90 and p99 of ``values_s`` (seconds) in milliseconds; None for no values."""
    if not values_s:
        return None
    ms = 1000.0 * np.asarray(values_s, dtype=np.float64)
    p90, p99 = np.percentile(ms, [90, 99])
    return Percentiles(mean=float(ms.mean()), median=float(np.median(ms)), p90=float(p90), p99=float(p99))


def duration_s(records: Sequence[RequestRecord]) -> float:
    """The level's wall time, seconds: first send → last token received by any measured request (0 if none)."""
    ends = [r.t_last for r in records if r.t_last is not None]
    if not records or not ends:
        return 0.0
    return max(0.0, max(ends) - min(r.t_sent for r in records))


def _sum_or_none(values: Sequence[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _rate(count: float | None, seconds: float) -> float | None:
    return None if count is None or seconds <= 0 else count / seconds


def throughputs(records: Sequence[RequestRecord], seconds: float, slo: Slo | None = None,
                prompt_tokens_client: int | None = None) -> dict[str, float | None]:
    """``request_throughput``, ``output_throughput``, ``total_token_throughput`` and ``request_goodput`` (per
    second over ``seconds``; goodput None without an SLO; a token throughput None when a completed request has
    no count for it)."""
    done = [r for r in records if completed(r)]
    out = _sum_or_none([output_tokens(r) for r in done])
    prompt = _sum_or_none([prompt_tokens(r, prompt_tokens_client) for r in done])
    good = sum(meets_slo(r, slo) for r in done) if slo is not None else None
    return {"request_throughput": _rate(len(done), seconds),
            "output_throughput": _rate(out, seconds),
            "total_token_throughput": _rate(None if out is None or prompt is None else out + prompt, seconds),
            "request_goodput": _rate(good, seconds)}


def level_stats(records: Sequence[RequestRecord], level: Level, slo: Slo | None = None,
                prompt_tokens_client: int | None = None, keep_log: bool = True) -> LevelStats:
    """Every metric of one load level from its measured requests' records (see the module docstring).

    ``prompt_tokens_client``: the prompt length the client generated, used where the server sent no usage.
    ``keep_log``: keep the records in ``requests_log``. Memory peaks are left to the caller.
    """
    done = [r for r in records if completed(r)]
    seconds = duration_s(records)
    rates = throughputs(records, seconds, slo, prompt_tokens_client)
    return LevelStats(
        mode=level.mode, concurrency=level.concurrency, rate=level.rate,
        requests=len(records), completed=len(done), failed=len(records) - len(done), duration_s=seconds,
        ttft_ms=percentiles_ms([v for r in done if (v := ttft_s(r)) is not None]),
        tpot_ms=percentiles_ms([v for r in done if (v := tpot_s(r)) is not None]),
        itl_ms=percentiles_ms([g for r in done for g in itl_gaps_s(r)]),
        e2el_ms=percentiles_ms([v for r in done if (v := e2el_s(r)) is not None]),
        dispatch_delay_ms=percentiles_ms([r.t_sent - r.t_target for r in records if r.t_target is not None]),
        request_throughput=rates["request_throughput"], output_throughput=rates["output_throughput"],
        total_token_throughput=rates["total_token_throughput"], request_goodput=rates["request_goodput"],
        requests_log=list(records) if keep_log else [])


# --- across levels ------------------------------------------------------------------------------------------


def attainment(stats: LevelStats, slo: Slo) -> float:
    """The fraction of a level's measured requests that completed within ``slo`` (0 for an empty level).

    Raises:
        ValueError: the level kept no ``requests_log`` to judge.
    """
    if stats.requests == 0:
        return 0.0
    if len(stats.requests_log) != stats.requests:
        raise ValueError(f"level has {stats.requests} requests but {len(stats.requests_log)} records; "
                         "compute it with keep_log=True")
    return sum(meets_slo(r, slo) for r in stats.requests_log) / stats.requests


def level_meets_slo(stats: LevelStats, slo: Slo, fraction: float = SLO_ATTAINMENT) -> bool:
    """At least ``fraction`` of the level's measured requests completed within ``slo``."""
    return attainment(stats, slo) >= fraction


def find_knee(levels: Sequence[LevelStats], slo: Slo, fraction: float = SLO_ATTAINMENT) -> dict[str, Any] | None:
    """The knee of an open-loop sweep: the highest rate that met the SLO below the first rate that did not.

    Returns ``None`` without Poisson levels, else ``{"slo", "attainment_required", "met_rate", "failed_rate",
    "attainment": {rate: fraction}}``; ``met_rate`` is None when even the lowest rate failed, ``failed_rate``
    None when every rate met the SLO (no knee reached within the sweep).
    """
    sweep = sorted((lv for lv in levels if lv.mode == "poisson" and lv.rate is not None),
                   key=lambda lv: float(lv.rate or 0.0))
    if not sweep:
        return None
    reached = {float(lv.rate or 0.0): attainment(lv, slo) for lv in sweep}
    met: float | None = None
    failed: float | None = None
    for rate, frac in reached.items():
        if frac < fraction:
            failed = rate
            break
        met = rate
    return {"slo": slo.describe(), "attainment_required": fraction, "met_rate": met, "failed_rate": failed,
            "attainment": {f"{rate:g}": frac for rate, frac in reached.items()}}
