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
