"""``quantyard work``: list and prune the shared work folder's cached intermediates (pipeline/workdir.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.common import JsonOpt, handle_errors, settings

work_app = typer.Typer(name="work", no_args_is_help=True,
                       help="The shared work folder: cached base GGUFs, EXL2 measurements, calibration texts, "
                            "tokenizer agreements.")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


@work_app.command("list")
@handle_errors
def work_list(as_json: JsonOpt = False) -> None:
    """Show every cached entry of the work folder: kind, key, size and when a run last used it."""
    import time

    from rich.table import Table

    from pipeline import workdir
    from pipeline.render import console, print_json

    root = settings().work_root
    now = time.time()
    rows = workdir.entries(root)
    scratch = workdir.scratch_bytes(root)
    if as_json:
        print_json({"root": str(root), "entries": [e.as_dict(now) for e in rows], "scratch_bytes": scratch})
        return
    table = Table("kind", "key", "size", "last used", header_style="bold", title=str(root))
    for e in rows:
        table.add_row(e.kind, e.key[:24], _gib(e.size_bytes), f"{e.age_days(now):.1f} days ago")
    console.print(table)
    total = sum(e.size_bytes for e in rows)
    console.print(f"{len(rows)} cached entries, {_gib(total)}; scratch of running or killed jobs {_gib(scratch)} "
                  "(swept by the next run once its process is gone)", markup=False, highlight=False)


@work_app.command("prune")
@handle_errors
def work_prune(
    older_than: Annotated[float, typer.Option(
        "--older-than", metavar="DAYS",
        help="Remove entries no run has used for more than DAYS days (0: every cached entry).")] = 30.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would go.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove cached intermediates no run has used lately (the next run that needs one rebuilds it). Refused
    while a running job holds the work folder; scratch of finished or killed jobs is swept too."""
    from flows.steps import sweep_stale
    from pipeline import workdir
    from pipeline.render import console, print_json

    cfg = settings()
    gone = workdir.prune(cfg.work_root, older_than, dry_run=dry_run)
    swept = [] if dry_run else sweep_stale(cfg)
    if as_json:
        print_json({"root": str(cfg.work_root), "dry_run": dry_run, "older_than_days": older_than,
                    "entries": [{**e.as_dict(), "removed": not dry_run} for e in gone],
                    "scratch_removed": [str(p) for p in swept]})
        return
    verb = "would remove" if dry_run else "removed"
    for e in gone:
        console.print(f"{verb} {e.kind}/{e.path.name} ({_gib(e.size_bytes)}, last used {e.age_days():.1f} days ago)",
                      markup=False, highlight=False)
    total = sum(e.size_bytes for e in gone)
    console.print(f"{len(gone)} cached entries unused for more than {older_than:g} days, {_gib(total)}"
                  + (f"; {len(swept)} leftovers of killed jobs swept" if swept else ""), markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(work_app, name="work")
