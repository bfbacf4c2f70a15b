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
    table = Table(title=title, caption=extra_caption, header_style="bold")
    for key, label in COLUMNS:
        table.add_column(label, justify="left" if key in ("variant", "engine", "status") else "right")
    for row in rows:
        table.add_row(*[_fmt(row.get(k)) for k, _ in COLUMNS])
    return table


def _fmt(value: Any) -> str:
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
