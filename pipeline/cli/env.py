"""``quantyard env``: list and build the managed tool environments (pipeline/envs.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from pipeline.cli.common import JsonOpt, handle_errors, settings

env_app = typer.Typer(name="env", no_args_is_help=True, help="Managed tool environments (awq, autoawq, vllm, exl2).")


@env_app.command("list")
@handle_errors
def env_list(as_json: JsonOpt = False) -> None:
    """Show every tool environment: state, interpreter, requirement file, key and size."""
    from rich.table import Table

    from pipeline import envs
    from pipeline.render import console, print_json

    cfg = settings()
    rows = [envs.status(name, cfg) for name in envs.ENVS]
    if as_json:
        print_json(rows)
        return
    table = Table("name", "state", "accelerator", "requirements", "key", "size", "python", header_style="bold")
    for r in rows:
        size = f"{r['size_bytes'] / 2**30:.2f} GiB" if r.get("size_bytes") else "—"
        table.add_row(r["name"], r["state"], r["accelerator"], r.get("requirements") or "—", r.get("key") or "—",
                      size, r.get("python") or "—")
    console.print(table)


def _plain(console: Any) -> Callable[[str], None]:
    """Print progress lines verbatim (pip's output holds brackets that rich would read as markup)."""
    return lambda line: console.print(line, markup=False, highlight=False)


@env_app.command("prune")
@handle_errors
def env_prune(dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would go.")] = False,
              as_json: JsonOpt = False) -> None:
    """Remove managed environments this checkout no longer builds (older pins or recipe): each is GBs."""
    from pipeline import envs
    from pipeline.render import console, print_json

    gone = envs.prune(settings(), dry_run=dry_run)
    if as_json:
        print_json([{"path": str(p), "size_bytes": n, "removed": not dry_run} for p, n in gone])
        return
    verb = "would remove" if dry_run else "removed"
    for path, size in gone:
        console.print(f"{verb} {path} ({size / 2**30:.2f} GiB)", markup=False, highlight=False)
    total = sum(n for _, n in gone) / 2**30
    console.print(f"{len(gone)} superseded environment(s), {total:.2f} GiB", markup=False, highlight=False)


@env_app.command("ensure")
@handle_errors
def env_ensure(names: Annotated[list[str], typer.Argument(help="Environment names (see `quantyard env list`).")],
               as_json: JsonOpt = False) -> None:
    """Build the named environments if they are missing (a built one is reused without any install)."""
    from pipeline import envs
    from pipeline.render import err_console, print_json

    cfg = settings()
    for name in names:
        envs.spec_for(name)  # an unknown name fails before anything is built
    names = list(dict.fromkeys(names))
    plain = _plain(err_console)

    def one(name: str) -> Callable[[], envs.EnvInfo]:
        def run() -> envs.EnvInfo:
            if not as_json:
                err_console.print(f"env {name}: checking…")
            info = envs.ensure(name, cfg, progress=None if as_json else lambda line: plain(f"[{name}] {line}"))
            if not as_json:
                what = "built" if info.created else "ready (nothing to do)"
                err_console.print(f"[green]✓[/] env {name}: {what}  {info.python}")
            return info
        return run

    built = envs.ensure_each({name: one(name) for name in names}, jobs=cfg.env_jobs)
    out = [{"name": name, "python": info.python, "key": info.key, "managed": info.managed,
            "created": info.created, "events": info.events, "packages": len(info.freeze)}
           for name, info in built.items()]
    if as_json:
        print_json(out)


def register(app: typer.Typer) -> None:
    app.add_typer(env_app, name="env")
