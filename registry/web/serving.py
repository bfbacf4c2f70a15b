"""Serving charts of a model's variants, laid out here and drawn as inline SVG by ``_serving_chart.html``.

Two line charts against concurrent users (x on a log2 scale, one tick per measured level): p99 time to first
token, and output tokens per second. One line per variant and engine (:func:`pipeline.serving_summary.
serving_summaries`), coloured from a categorical palette and named in the legend with its marks: ``¶`` a
CPU-scaled load shape, ``§`` a vLLM server whose 4-bit kernel Quantyard replaced (pipeline.shown). y is
logarithmic when the values span more than a factor of ten, else linear from zero. A level with failed
requests is drawn hollow (its percentiles leave those requests out). Notes say when the lines come from
different load shapes or machines: their figures are comparable only within one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.serving_summary import ServingSummary, hardware_note, profiles_note
from registry.web.chart import Tick, _linear_ticks

WIDTH, HEIGHT = 720, 340
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 20, 50
#: A categorical palette (Tableau 10): lines of one format must still be told apart.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
#: Dash patterns cycle after the palette, so that the 11th line differs from the 1st.
DASHES = (None, "6 3", "2 3", "8 3 2 3")
#: (chart id, figure of a level, title, y label, higher is better).
CHARTS = (("serving-ttft", "ttft_p99_ms", "p99 time to first token", "p99 TTFT (ms)", False),
          ("serving-throughput", "output_throughput", "output throughput", "output tok/s", True))
LOG_SPAN = 10.0  # y is logarithmic when max / min exceeds this


@dataclass(frozen=True)
class SeriesPoint:
    x: float
    y: float
    concurrency: int
    value: float
    title: str
    hollow: bool = False  # the level had failed requests


@dataclass
class Series:
    label: str  # variant · engine
    ref: str
    engine: str
    colour: str
    dash: str | None
    symbols: str  # the marks' symbols (¶ §)
    points: list[SeriesPoint] = field(default_factory=list)

    @property
    def path(self) -> str:
        return " ".join(f"{p.x:.1f},{p.y:.1f}" for p in self.points)


@dataclass
class LineChart:
    chart_id: str
    metric: str
    title: str
    y_label: str
    log_y: bool
    x_label: str = "concurrent users (log scale)"
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    top: int = TOP
    plot_w: int = WIDTH - LEFT - RIGHT
    plot_h: int = HEIGHT - TOP - BOTTOM
    series: list[Series] = field(default_factory=list)
    x_ticks: list[Tick] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    not_plotted: list[str] = field(default_factory=list)
    has_failures: bool = False


@dataclass
class ServingCharts:
    """Everything the serving section shows: the charts and the notes under them."""

    charts: list[LineChart]
    summaries: list[ServingSummary]
    notes: list[str] = field(default_factory=list)


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    return f"{v:g}" if v >= 1 else f"{v:.2g}"


def _log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """Decades, with 2 and 5 between them when the range spans at most two decades."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    b = b + 1 if a == b else b
    steps = (1, 2, 5) if b - a <= 2 else (1,)
    ticks = [m * 10.0 ** k for k in range(a, b + 1) for m in steps if m * 10.0 ** k <= 10.0 ** b]
    return 10.0 ** a, 10.0 ** b, ticks


def _y_axis(values: Sequence[float]) -> tuple[bool, float, float, list[float]]:
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo > LOG_SPAN:
        y0, y1, ticks = _log_ticks(lo, hi)
        return True, y0, y1, ticks
    y0, y1, ticks = _linear_ticks(0.0, hi * 1.05 if hi > 0 else 1.0)
    return False, y0, y1, ticks


def _x_axis(levels: Sequence[int]) -> tuple[float, float]:
    a, b = math.log2(min(levels)), math.log2(max(levels))
    pad = max((b - a) * 0.05, 0.5)
    return a - pad, b + pad


def build_chart(summaries: Sequence[ServingSummary], spec: tuple[str, str, str, str, bool]) -> LineChart | None:
    """One line chart of ``spec`` (see :data:`CHARTS`), or None when no summary has that figure."""
    chart_id, key, title, y_label, _ = spec
    have = [(s, [(lv, lv.value(key)) for lv in s.levels if lv.value(key) is not None]) for s in summaries]
    values = [float(v) for _, pts in have for _, v in pts if v is not None]
    if not values:
        return None
    log, y0, y1, yt = _y_axis(values)
    x0, x1 = _x_axis([lv.concurrency for _, pts in have for lv, _ in pts])
    chart = LineChart(chart_id=chart_id, metric=key, title=title, y_label=y_label + (" (log)" if log else ""),
                      log_y=log)

    def px(c: int) -> float:
        return chart.left + (math.log2(c) - x0) / (x1 - x0) * chart.plot_w

    def py(v: float) -> float:
        lo, hi, val = (math.log10(y0), math.log10(y1), math.log10(max(v, y0))) if log else (y0, y1, v)
        return chart.top + (1 - (val - lo) / (hi - lo)) * chart.plot_h

    for i, (s, pts) in enumerate(have):
        if not pts:
            chart.not_plotted.append(f"{s.label} ({title} not measured)")
            continue
        series = Series(s.label, s.ref, s.engine, PALETTE[i % len(PALETTE)], DASHES[(i // len(PALETTE)) % len(DASHES)],
                        s.symbols)
        for lv, v in pts:
            assert v is not None
            failed = f" · {lv.failed} of {lv.requests} requests failed (left out of the percentiles)" \
                if lv.failed else ""
            series.points.append(SeriesPoint(px(lv.concurrency), py(v), lv.concurrency, v,
                                             f"{s.label}{s.symbols} · {lv.concurrency} users · {y_label} {_fmt(v)}"
                                             f" · {s.profile} profile{failed}", hollow=bool(lv.failed)))
        chart.series.append(series)
    chart.has_failures = any(p.hollow for s in chart.series for p in s.points)
    levels = sorted({p.concurrency for s in chart.series for p in s.points})
    chart.x_ticks = [Tick(px(c), str(c)) for c in levels]
    chart.y_ticks = [Tick(py(t), _fmt(t)) for t in yt]
    return chart


def build_serving_charts(summaries: Sequence[ServingSummary]) -> ServingCharts | None:
    """The serving section of a model or compare page, or None when nothing was served."""
    summaries = [s for s in summaries if s.levels]
    if not summaries:
        return None
    charts = [c for c in (build_chart(summaries, spec) for spec in CHARTS) if c is not None]
    notes = [n for n in (profiles_note(summaries), hardware_note(summaries)) if n]
    scaled = [s.label for s in summaries if s.cpu_scaled]
    if scaled:
        notes.append("CPU-scaled load shapes (¶): " + "; ".join(
            f"{s.label}: {s.profile_note or s.shape}" for s in summaries if s.cpu_scaled))
    return ServingCharts(charts=charts, summaries=list(summaries), notes=notes)


def shown_metrics(kind: str, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A result's metrics as the version page prints them: a serving result's per-request logs replaced by their
    count (they can run to megabytes; the JSON API's ``/-/results`` has them whole)."""
    if kind != "serving" or not isinstance(metrics.get("levels"), list):
        return dict(metrics)
    levels = [{**{k: v for k, v in lv.items() if k != "requests_log"},
               "requests_log": f"{len(lv.get('requests_log') or [])} records: see /-/results in the JSON API"}
              if isinstance(lv, dict) else lv for lv in metrics["levels"]]
    return {**metrics, "levels": levels}
