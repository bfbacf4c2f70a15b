"""How numbers and table cells look on the pages (the JSON API returns the raw values)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from urllib.parse import quote

from markupsafe import Markup

from registry.web.table import METRICS, QUALITY_KEYS, SPEED_KEYS, Row


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
    if kind == "kld":
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
    """The metric cells of a row, in :data:`METRICS` order; a missing figure says why."""
    out = []
    for key in METRICS:
        v = getattr(row, key)
        if v is not None:
            title = f"± {row.ppl_se:.3f} (s.e.)" if key == "ppl" and row.ppl_se else None
            out.append(Cell(f"n m-{key}", repr(v), number(v, key), title))
            continue
        err = row.quality_error if key in QUALITY_KEYS else row.speed_error if key in SPEED_KEYS else None
        out.append(Cell(f"n m-{key} missing", "", row.reason(key) or "", err[:500] if err else None))
    return out
