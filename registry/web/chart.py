"""Size-vs-quality chart of a model's variants, laid out here and drawn as inline SVG by a template.

y is KLD against the reference (log scale) when any variant has it, else PPL (linear). One marker per
variant, coloured by format; the Pareto front (no other variant is both smaller and better) is a line.

Only comparable points make the front: engine-measured ones (a stand-in, pipeline.shown.role_of, is drawn
as a hollow diamond and left off it) and, on the KLD axis, KLDs of one kind (exact when any variant has
one; a top-K lower bound or an estimate is drawn hollow and left off a front of exact values). The
caption's notes say what was left off and why.

With a measured noise floor (registry.web.table ``chart_floor``: the KLD between the reference and a second
unquantized run differing only in arithmetic), the KLD axis draws it as a dashed line with its 95 % band: a variant
on or under it cannot be told from the reference on these windows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.formats import FORMATS
from registry.web.table import Row, pareto_front

WIDTH, HEIGHT = 720, 360
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 20, 50
#: Colours for formats this installation does not know (registered by another one); known formats use
#: their FormatInfo.colour.
PALETTE = ("#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    colour: str
    label: str
    ref: str
    title: str
    on_front: bool
    shape: str = "circle"  # circle: engine-measured; diamond: a stand-in engine
    hollow: bool = False  # not comparable with the front's points (a stand-in, a KLD of another kind)
    kind: str = "engine"  # the row's engine role


@dataclass(frozen=True)
class Tick:
    pos: float
    label: str


MAX_LABELS = 24  # beyond this, markers keep only their tooltips


@dataclass
class Chart:
    metric: str  # kld | ppl
    y_label: str
    x_label: str
    width: int = WIDTH
    height: int = HEIGHT
    points: list[Point] = field(default_factory=list)
    front: list[tuple[float, float]] = field(default_factory=list)
    x_ticks: list[Tick] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    legend: list[tuple[str, str]] = field(default_factory=list)  # (format, colour)
    not_plotted: list[tuple[str, str]] = field(default_factory=list)  # (variant, reason)
    notes: list[str] = field(default_factory=list)  # what is not on the front, and why
    has_stand_ins: bool = False
    #: The noise floor's line (y), its 95 % band (top y, bottom y) and its caption; None without one.
    floor_y: float | None = None
    floor_band: tuple[float, float] | None = None
    floor_label: str | None = None
    labels: bool = True
    left: int = LEFT
    top: int = TOP
    plot_w: int = WIDTH - LEFT - RIGHT
    plot_h: int = HEIGHT - TOP - BOTTOM

    @property
    def front_path(self) -> str:
        return " ".join(f"{x:.1f},{y:.1f}" for x, y in self.front)


def format_colours(formats: Sequence[str]) -> dict[str, str]:
    known = {str(f): info.colour for f, info in FORMATS.items()}
    others = sorted({f for f in formats if f not in known})
    return {**known, **{f: PALETTE[i % len(PALETTE)] for i, f in enumerate(others)}}


def _nice_step(span: float, count: int = 5) -> float:
    raw = span / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def _linear_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    if hi <= lo:
        lo, hi = lo - abs(lo) * 0.1 - 1e-9, hi + abs(hi) * 0.1 + 1e-9
    step = _nice_step(hi - lo)
    start, end = math.floor(lo / step) * step, math.ceil(hi / step) * step
    n = round((end - start) / step)
    return start, end, [start + i * step for i in range(n + 1)]


def _log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    if a == b:
        b += 1
    return 10.0 ** a, 10.0 ** b, [10.0 ** k for k in range(a, b + 1)]


def size_unit(max_bytes: float) -> tuple[float, str]:
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if max_bytes >= div:
            return div, unit
    return 1.0, "B"


def _fmt(v: float, log: bool) -> str:
    if log:
        return f"1e{round(math.log10(v))}"
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.3g}"


def build_chart(rows: Sequence[Row], noise_floor: Mapping[str, Any] | None = None) -> Chart | None:
    """Lay out the chart, or None when no variant has a size and a quality figure; ``noise_floor``: the floor to
    draw on the KLD axis (module docstring)."""
    metric = "kld" if any(r.kld_shown.value is not None for r in rows) else "ppl"
    plotted = [r for r in rows if r.value(metric) is not None and r.size]
    if not plotted:
        return None
    log = metric == "kld"
    floor = min((float(r.value("kld")) for r in plotted if r.value("kld") > 0), default=1e-6) / 2 if log else 0.0
    values = [max(float(r.value(metric)), floor) if log else float(r.value(metric)) for r in plotted]
    band = _floor_band(noise_floor) if log else None
    span = [*values, *(band or ())]
    div, unit = size_unit(max(float(r.size or 0) for r in plotted))
    sizes = [float(r.size or 0) / div for r in plotted]
    x0, x1, xt = _linear_ticks(0.0, max(sizes) * 1.05)
    y0, y1, yt = _log_ticks(min(span), max(span)) if log else _linear_ticks(min(values), max(values))
    chart = Chart(metric=metric, y_label="KLD vs reference (log)" if log else "perplexity",
                  x_label=f"size ({unit})")

    def px(x: float) -> float:
        return chart.left + (x - x0) / (x1 - x0) * chart.plot_w

    def py(y: float) -> float:
        frac = (math.log10(y) - math.log10(y0)) / (math.log10(y1) - math.log10(y0)) if log else (y - y0) / (y1 - y0)
        return chart.top + (1 - frac) * chart.plot_h

    colours = format_colours([r.format for r in rows])
    eligible, chart.notes = front_basis(plotted, metric)
    basis = [i for i, r in enumerate(plotted) if id(r) in eligible]
    front = {basis[j] for j in pareto_front([(sizes[i], values[i]) for i in basis])}
    for i, r in enumerate(plotted):
        chart.points.append(Point(px(sizes[i]), py(values[i]), colours[r.format], r.variant, r.ref,
                                  _title(r, metric, f"{sizes[i]:.3g} {unit}", chart.y_label), i in front,
                                  shape="diamond" if r.engine_role == "stand-in" else "circle",
                                  hollow=id(r) not in eligible, kind=r.engine_role))
    if band is not None and noise_floor is not None:
        mean = float(noise_floor["kld_mean"])
        chart.floor_y, chart.floor_band = py(mean), (py(band[1]), py(band[0]))
        shared = (f", the reference of {noise_floor['rows']} of the {noise_floor['of']} rows with an exact KLD"
                  if noise_floor.get("of") and noise_floor.get("rows") != noise_floor.get("of") else "")
        chart.floor_label = (f"noise floor: KLD {mean:.3g} between the reference and {noise_floor.get('engine')} "
                             f"on the unquantized model{shared}; on or under it, a variant cannot be told from "
                             "the reference")
    chart.has_stand_ins = any(p.shape == "diamond" for p in chart.points)
    chart.labels = len(chart.points) <= MAX_LABELS
    chart.front = sorted((p.x, p.y) for p in chart.points if p.on_front)
    chart.x_ticks = [Tick(px(t), _fmt(t, False)) for t in xt]
    chart.y_ticks = [Tick(py(t), _fmt(t, log)) for t in yt]
    chart.legend = [(f, colours[f]) for f in sorted({r.format for r in plotted})]
    shown = {id(r) for r in plotted}
    chart.not_plotted = [(r.variant, r.reason(metric) or "no size") for r in rows if id(r) not in shown]
    return chart


def _floor_band(floor: Mapping[str, Any] | None) -> tuple[float, float] | None:
    """The noise floor's 95 % band (low, high) on a log axis (the mean both ways without an interval); None
    without a positive floor."""
    if not floor or not isinstance(floor.get("kld_mean"), int | float) or floor["kld_mean"] <= 0:
        return None
    mean = float(floor["kld_mean"])
    low, high = floor.get("kld_ci95_low"), floor.get("kld_ci95_high")
    low = float(low) if isinstance(low, int | float) and low > 0 else mean
    high = float(high) if isinstance(high, int | float) and high > 0 else mean
    return min(low, mean), max(high, mean)


def _title(r: Row, metric: str, size: str, y_label: str) -> str:
    kind = r.kld_shown.kind if metric == "kld" else "exact"
    prefix = {"lower_bound": "≥", "estimate": "≈"}.get(kind, "")
    return f"{r.ref} · {r.format} {r.quant} · {size} · {y_label.split(' ')[0]} {prefix}{r.value(metric):.4g}" + \
        (f" · {r.engine}" if r.engine else "") + (f" ({r.engine_role})" if r.engine_role != "engine" else "")


def front_basis(plotted: Sequence[Row], metric: str) -> tuple[set[int], list[str]]:
    """The ids of the rows a Pareto front may hold, and a note for each kind of row left off it."""
    engine = [r for r in plotted if r.engine_role != "stand-in"]
    notes = []
    if len(engine) < len(plotted):
        stand_ins = sorted({r.engine or "" for r in plotted if r.engine_role == "stand-in"})
        notes.append(f"hollow diamonds: stand-in engines ({', '.join(stand_ins)}), not the formats' own; "
                     "not on the Pareto front, which holds engine-measured points only")
    if metric == "kld":
        kinds = [r.kld_shown.kind for r in engine]
        kind = next((k for k in ("exact", "lower_bound", "estimate") if k in kinds), "exact")
        off = [r for r in engine if r.kld_shown.kind != kind]
        engine = [r for r in engine if r.kld_shown.kind == kind]
        if off:
            what = {"exact": "exact", "lower_bound": "lower-bound", "estimate": "estimated"}[kind]
            notes.append(f"hollow circles: a KLD of another kind than the front's ({what}) — a top-K lower bound "
                         f"(≥) or an estimate (≈); not on the front: {', '.join(r.variant for r in off)}")
    return {id(r) for r in engine}, notes
