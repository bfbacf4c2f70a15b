"""How numbers and table cells look on the pages (the JSON API returns the raw values)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from html import escape
from urllib.parse import quote

from markupsafe import Markup

from pipeline.serving_summary import CPU_SCALED_PROFILE, MemorySummary
from pipeline.shown import (
    CPU_SCALED,
    DENSE_KERNEL,
    WITHIN_FLOOR,
    Mark,
    engine_mark,
    eval_sets_note,
    kld_mark,
    kld_text,
    legend,
    row_figures,
    shown_kld,
)
from registry.web.table import METRICS, QUALITY_KEYS, SPEED_KEYS, Row, SecondFigure


def human_size(n: int | None) -> str:
    """Bytes in decimal units, as the CLI prints sizes (MB = 10^6 bytes)."""
    if n is None:
        return ""
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def path_quote(value: str) -> str:
    """A registry name or reference as a URL path (``/`` and ``@`` kept, everything else escaped)."""
    return quote(str(value), safe="/@")


def number(x: float | None, kind: str = "") -> str:
    """Table formatting: KLD in scientific notation, ΔPPL with its sign, speeds without decimals."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if kind == "size":
        return human_size(int(x))
    if kind in ("kld", "kld_p99"):
        return f"{x:.3e}"
    if kind == "delta_ppl_pct":
        return f"{x:+.1e}" if 0 < abs(x) < 0.01 else f"{x:+.3f}"
    if kind in ("pp_tok_s", "tg_tok_s"):
        return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"
    if kind == "bpw":
        return f"{x:.3f}"
    if kind == "ppl":
        return f"{x:.4f}" if x < 1000 else f"{x:,.1f}"
    return f"{x:.2f}"


@dataclass(frozen=True, slots=True)
class Cell:
    """One metric cell of a page table: a sortable value (``data-v``), its text, and a tooltip."""

    css: str
    value: str  # "" when missing: sorts last
    text: str
    title: str | None = None


def metric_cells_html(row: Row) -> Markup:
    """The metric ``<td>`` cells of a row as HTML. Built here rather than in a template macro because a
    model page has hundreds of rows × eight cells; every interpolated value is escaped."""
    out = []
    for c in metric_cells(row):
        title = f' title="{escape(c.title)}"' if c.title else ""
        out.append(f'<td class="{c.css}" data-v="{escape(c.value)}"{title}>{escape(c.text)}</td>')
    return Markup("".join(out))  # assembled from escaped parts above


def metric_cells(row: Row) -> list[Cell]:
    """The metric cells of a row, in :data:`METRICS` order; a missing figure says why, a figure that is not
    what its header alone says carries its marker (pipeline.shown) and says why in its tooltip."""
    out = []
    for key in METRICS:
        v = row.value(key)
        if v is not None:
            text, title, extra = _shown(row, key, v)
            out.append(Cell(f"n m-{key}{extra}", repr(v), text, title))
            continue
        err = row.quality_error if key in QUALITY_KEYS else row.speed_error if key in SPEED_KEYS else None
        out.append(Cell(f"n m-{key} missing", "", row.reason(key) or "", err[:500] if err else None))
    return out


def cell_text(row: Row, key: str) -> str:
    """A metric's text as a cell shows it, marker included ("" when missing)."""
    v = row.value(key)
    return "" if v is None else _shown(row, key, v)[0]


def _shown(row: Row, key: str, v: float) -> tuple[str, str | None, str]:
    """A present figure's text, tooltip and extra CSS classes."""
    if key in QUALITY_KEYS and row.quality_kernel:  # computed with the dense-matmul stand-in for vLLM's kernel
        text, title, extra = _shown(row.model_copy(update={"quality_kernel": None}), key, v)
        said = f"{DENSE_KERNEL.line} ({row.quality_kernel})"
        return text + DENSE_KERNEL.symbol, f"{title}; {said}" if title else said, extra + " marked"
    if key == "kld":
        k = row.kld_shown
        mark = kld_mark(k)
        ci = f"95 % CI {number(row.kld_ci95_low, 'kld')}–{number(row.kld_ci95_high, 'kld')}" \
            if row.kld_ci95_low is not None and row.kld_ci95_high is not None else None
        floor = WITHIN_FLOOR.line if row.within_noise_floor else None
        title = "; ".join(t for t in (mark.line if mark else None, k.method, ci, floor) if t) or None
        text = kld_text(k, lambda x: number(x, "kld")) + (WITHIN_FLOOR.symbol if floor else "")
        return text, title, f" kld-{k.kind}" + (" marked" if mark or floor else "")
    if key in SPEED_KEYS and row.speed_kernel:
        return number(v, key) + DENSE_KERNEL.symbol, f"{DENSE_KERNEL.line} ({row.speed_kernel})", " marked"
    if key in ("ppl", "delta_ppl_pct"):
        lo, hi = getattr(row, f"{key}_ci95_low"), getattr(row, f"{key}_ci95_high")
        if lo is not None and hi is not None:
            return number(v, key), f"95 % CI {number(lo, key)} to {number(hi, key)}", ""
        if key == "ppl" and row.ppl_se:
            return number(v, key), f"± {row.ppl_se:.3f} (s.e.)", ""
    return number(v, key), None, ""


def engine_html(row: Row) -> Markup:
    """The engine cell's content: the engine with its marker (a stand-in ``*``), its version, the speed's
    engine when another one, and each cross-check's figures on a line of its own. Escaped."""
    mark = engine_mark(row.format, row.engine, row.engine_role)
    parts = []
    if row.engine:
        sym = f'<span class="mark" title="{escape(mark.line)}">{escape(mark.symbol)}</span>' if mark else ""
        parts.append(f'<span class="engine role-{escape(row.engine_role)}">{escape(row.engine)}</span>{sym}')
        if row.engine_version:
            parts.append(f' <span class="muted engine-version">{escape(row.engine_version)}</span>')
        if row.speed_engine and row.speed_engine != row.engine:
            parts.append(f" / {escape(row.speed_engine)}")
    for c in row.cross_checks:
        parts.append(second_html(row.format, c))
    return Markup("".join(parts))  # assembled from escaped parts above


def engine_label(row: Row) -> Markup:
    """The engine of a row with its marker only (a stand-in ``*``, another engine ``°``): a history line. Escaped."""
    mark = engine_mark(row.format, row.engine, row.engine_role)
    sym = f'<span class="mark" title="{escape(mark.line)}">{escape(mark.symbol)}</span>' if mark else ""
    return Markup(f"{escape(row.engine or '')}{sym}")  # assembled from escaped parts


def second_html(fmt: str, c: SecondFigure) -> str:
    """A second figure (a cross-check, or a stand-in beside the engine) as one labelled line."""
    mark = engine_mark(fmt, c.engine, c.role)
    k = shown_kld(c)
    figures = [f"PPL {number(c.ppl, 'ppl')}" if c.ppl is not None else None,
               f"KLD {kld_text(k, lambda x: number(x, 'kld'))}" if k.value is not None else None,
               f"top-1 {number(c.top1_pct)} %" if c.top1_pct is not None else None]
    text = f"{mark.symbol if mark else ''} {c.role} on {c.engine}: " + " · ".join(f for f in figures if f)
    title = mark.line if mark else c.role
    return f'<div class="second role-{escape(c.role)}" title="{escape(title)}">{escape(text.strip())}</div>'


def ms(x: float | None) -> str:
    """A latency in milliseconds for a serving table (``—`` when not measured)."""
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def tok_s(x: float | None) -> str:
    """A throughput in tokens per second for a serving table (``—`` when not measured)."""
    return "—" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def memory_html(row: Row) -> Markup:
    """The memory cell of a row: ``fits in 5.20 GB at context 8,192 with 64 users`` with the serving result's
    marks, what the peak is in its tooltip, and the peak in bytes as its sort value; why there is none. Escaped."""
    if row.memory_peak_bytes is None:
        return Markup(f'<td class="memory missing" data-v="">{escape(row.reason("memory") or "")}</td>')
    mem = MemorySummary(peak_bytes=row.memory_peak_bytes, source=row.memory_source,  # type: ignore[arg-type]
                        context=row.memory_context, users=row.memory_users)
    marks = [m for m, on in ((CPU_SCALED, row.memory_profile == CPU_SCALED_PROFILE), (DENSE_KERNEL, row.memory_kernel))
             if on]
    sym = "".join(f'<span class="mark" title="{escape(m.line)}">{escape(m.symbol)}</span>' for m in marks)
    title = f"{mem.what}, serving on {row.memory_engine} ({row.memory_profile} load profile)"
    return Markup(f'<td class="memory" data-v="{row.memory_peak_bytes}" title="{escape(title)}">'
                  f"{escape(mem.text)}{sym}</td>")  # assembled from escaped parts above


def page_marks(rows: Iterable[Row]) -> list[Mark]:
    """The legend of a page: the marks its rows use."""
    return legend(k for r in rows for k in r.marks)


def sets_note(rows: Iterable[Row]) -> str | None:
    """A note naming the window sets / references when a page's quality figures come from more than one."""
    return eval_sets_note(row_figures(r.model_dump() for r in rows))
