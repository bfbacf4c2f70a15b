"""Rich rendering for the CLI: results tables, version details, progress."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.progress import Event, Throttle, describe, listening

console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

COLUMNS = [("variant", "variant"), ("size_mb", "size MB"), ("bpw", "bpw"), ("ppl", "PPL"),
           ("delta_ppl_pct", "ΔPPL %"), ("kld", "KLD"), ("kld_p99", "KLD p99"), ("top1_pct", "top-1 %"),
           ("pp_tok_s", "pp tok/s"),
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
    cells["kld"] = (kld_text(shown_kld(row), fmt_number) or "—") + ("≃" if row.get("within_noise_floor") else "")
    fmt = str(row.get("format") or "")
    mark = engine_mark(fmt, row.get("engine") or None, role or row.get("engine_role") or "engine")
    if mark is not None:
        cells["engine"] += mark.symbol
    for kernel, keys in (("speed_kernel", ("pp_tok_s", "tg_tok_s")),
                         ("quality_kernel", ("ppl", "delta_ppl_pct", "kld", "kld_p99", "top1_pct"))):
        if row.get(kernel):  # a dense-matmul stand-in for vLLM's 4-bit kernel made these figures
            for k in keys:
                cells[k] += "§" if cells[k] != "—" else ""
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
    """Each running stage on stderr (convert base, build, reference, evaluate...), with where its tool is when it
    says (tensor i of N, window i of N, tokens/s, ETA: pipeline/progress.py). A terminal gets a live line per
    stage; anything else (a log file, CI) a line when a stage starts and ends and a progress line each tenth of
    the way or each minute."""
    if not enabled:  # --json: stdout is the report; what the user must know still goes to stderr
        with listening(_notes_only):
            yield
        return
    if not err_console.is_terminal:
        with listening(_plain_lines(Throttle())):
            yield
        return
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24),
                   TextColumn("{task.fields[where]}"), TimeElapsedColumn(), console=err_console, transient=False)
    running: dict[tuple[str, str], TaskID] = {}
    clock = Throttle()

    def on_event(ev: Event) -> None:
        key = (ev.stage, ev.detail)
        label = f"{ev.stage} {ev.detail}".strip()
        if ev.phase == "note":
            bar.console.print(f"[yellow]note[/]: {escape(ev.detail)}")
        elif ev.phase == "start":
            clock.due(ev)
            running[key] = bar.add_task(label, total=None, where="")
        elif ev.phase == "progress" and key in running:
            bar.update(running[key], completed=ev.done, total=ev.total, where=describe(ev, clock.elapsed(ev)))
        elif key in running:
            mark = "[green]✓[/]" if ev.phase == "done" else "[red]✗[/]"
            task = running.pop(key)
            bar.update(task, completed=1, total=1, description=f"{mark} {label}")

    with bar, listening(on_event):
        yield


def _notes_only(ev: Event) -> None:
    if ev.phase == "note":
        err_console.print(f"note: {ev.detail}", highlight=False, markup=False)


def _plain_lines(clock: Throttle) -> Callable[[Event], None]:
    def on_event(ev: Event) -> None:
        label = f"{ev.stage} {ev.detail}".strip()
        if ev.phase == "note":
            err_console.print(f"note: {ev.detail}", highlight=False, markup=False)
        elif ev.phase == "start":
            clock.due(ev)
            err_console.print(f"→ {label}", highlight=False)
        elif ev.phase == "progress":
            if clock.due(ev):
                err_console.print(f"  {label}: {describe(ev, clock.elapsed(ev))}", highlight=False)
        else:
            mark = "✓" if ev.phase == "done" else "✗"
            err_console.print(f"{mark} {label} ({clock.elapsed(ev):.1f} s)", highlight=False)

    return on_event


def usage_table(stages: list[dict[str, Any]]) -> Table | None:
    """Time and memory of each stage that ran (pipeline/resources.py: the stage's own peak, its tools included,
    and the machine's memory in use at its peak); None when none ran."""
    from pipeline.resources import gib

    ran = [s for s in stages if s.get("status") == "ran" and s.get("usage")]
    if not ran:
        return None
    table = Table(title="time and memory per stage", header_style="bold", title_justify="left")
    for label in ("stage", "seconds", "own memory (peak)", "machine in use (peak)"):
        table.add_column(label, justify="left" if label == "stage" else "right")
    for s in ran:
        u = s["usage"]
        table.add_row(s["stage"], f"{u['wall_s']:.1f}", gib(u.get("peak_process_bytes")),
                      gib(u.get("peak_in_use_bytes")))
    return table
