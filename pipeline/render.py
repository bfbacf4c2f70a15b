"""Rich rendering for the CLI: results tables, version details, progress."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.progress import Event, listening

console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

COLUMNS = [("variant", "variant"), ("size_mb", "size MB"), ("bpw", "bpw"), ("ppl", "PPL"),
           ("delta_ppl_pct", "ΔPPL %"), ("kld", "KLD"), ("top1_pct", "top-1 %"), ("pp_tok_s", "pp tok/s"),
           ("tg_tok_s", "tg tok/s"), ("engine", "engine"), ("status", "status")]


def results_table(title: str, rows: list[dict[str, Any]], extra_caption: str | None = None) -> Table:
    """The human results table of :func:`pipeline.shown.table_rows` rows: numbers rounded for reading, every
    number that is not what its header says marked (``≥…†`` a KLD bound, ``*`` a stand-in engine, ``§`` a
    dense-matmul kernel, ``×`` a cross-check row), the legend of the marks used and, when the quality
    figures come from more than one window set or reference, a note naming them in the caption."""
    from pipeline.shown import eval_sets_note, legend, row_figures

    lines = [extra_caption] if extra_caption else []
    note = eval_sets_note(row_figures(rows))
    lines += [f"note: {note}"] if note else []
    lines += [m.line for m in legend(k for r in rows for k in r.get("marks") or [])]
    table = Table(title=title, caption="\n".join(lines) or None, caption_justify="left", header_style="bold")
    for key, label in COLUMNS:
        table.add_column(label, justify="left" if key in ("variant", "engine", "status") else "right")
    for row in rows:
        table.add_row(*_cells(row))
        for check in row.get("cross_checks") or []:
            table.add_row(*_cells({**check, "format": row.get("format"), "variant": f"  └ {check['role']}",
                                   "status": check["role"]},
                                  role=check["role"]))
    return table


def _cells(row: dict[str, Any], role: str | None = None) -> list[str]:
    from pipeline.shown import engine_mark, kld_text, shown_kld

    cells = {k: fmt_number(row.get(k)) for k, _ in COLUMNS}
    cells["kld"] = kld_text(shown_kld(row), fmt_number) or "—"
    fmt = str(row.get("format") or "")
    mark = engine_mark(fmt, row.get("engine") or None, role or row.get("engine_role") or "engine")
    if mark is not None:
        cells["engine"] += mark.symbol
    if row.get("speed_kernel"):
        for k in ("pp_tok_s", "tg_tok_s"):
            cells[k] += "§" if row.get(k) is not None else ""
    return [cells[k] for k, _ in COLUMNS]


def fmt_number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2e}"
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def progress(enabled: bool) -> Iterator[None]:
    """Show a spinner line per running stage (convert base, build, evaluate...) on stderr."""
    if not enabled or not err_console.is_terminal:
        yield
        return
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                   transient=False)
    running: dict[tuple[str, str], TaskID] = {}

    def on_event(ev: Event) -> None:
        key = (ev.stage, ev.detail)
        label = f"{ev.stage} {ev.detail}".strip()
        if ev.phase == "start":
            running[key] = bar.add_task(label, total=1)
        elif key in running:
            mark = "[green]✓[/]" if ev.phase == "done" else "[red]✗[/]"
            bar.update(running.pop(key), completed=1, description=f"{mark} {label}")

    with bar, listening(on_event):
        yield
