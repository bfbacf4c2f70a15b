"""Reading the registry: ``quantyard models``, ``variants``, ``show``, ``compare`` and ``pull``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.cli.common import JsonOpt, RegistryOpt, handle_errors, settings


@handle_errors
def models(registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """List the models in the registry."""
    from pipeline.render import console, print_json
    from registry import open_registry

    rows = open_registry(settings(registry)).list_models()
    if as_json:
        print_json([m.model_dump() for m in rows])
        return
    from rich.table import Table

    table = Table("model", "architecture", "variants", "versions", "created", header_style="bold")
    for m in rows:
        table.add_row(m.name, m.architecture or "—", str(m.variants), str(m.versions), m.created_at[:19])
    console.print(table)


@handle_errors
def variants(model: str, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """List the variants of MODEL and their versions."""
    from pipeline.render import console, print_json
    from registry import open_registry

    rows = open_registry(settings(registry)).list_variants(model)
    if as_json:
        print_json([v.model_dump() for v in rows])
        return
    from rich.table import Table

    table = Table("variant", "format", "versions", "latest", "reference", header_style="bold")
    for v in rows:
        table.add_row(v.name, v.format, ",".join(map(str, v.versions)), str(v.latest), f"{model}/{v.name}@{v.latest}")
    console.print(table)


@handle_errors
def show(ref: Annotated[str, typer.Argument(help="MODEL/VARIANT[@VERSION]")], registry: RegistryOpt = None,
         as_json: JsonOpt = False) -> None:
    """Show one version: files, lineage and results."""
    from pipeline.render import console, print_json
    from registry import open_registry

    view = open_registry(settings(registry)).get_version(ref)
    if as_json:
        print_json({**view.model_dump(mode="json"), "ref": view.ref})
        return
    console.print(f"[bold]{view.ref}[/]  {view.format}  state={view.state}  created {view.created_at[:19]}")
    console.print(f"source: {view.source['identity']}")
    for f in view.files:
        console.print(f"  {f.name}  {f.size:,} B  sha256:{f.sha256}")
    for r in view.results:
        summary = {k: v for k, v in r.metrics.items() if k in ("ppl", "delta_ppl_pct", "kld_mean", "top1_agreement")}
        console.print(f"  result {r.kind} on {r.engine} ({r.engine_version}): {r.status} {summary or ''}")
        for line in computed_as(r.metrics):
            console.print(f"    [yellow]{line}[/]")
    console.print_json(data=view.lineage)


def computed_as(metrics: dict[str, Any]) -> list[str]:
    """How a result was computed, where that is not what the file alone says: the dtype the engine ran
    in (and why it differs from the checkpoint's), the kernel that replaced the engine's own, a stand-in."""
    lines = []
    if metrics.get("dtype"):
        note = f" ({metrics['dtype_note']})" if metrics.get("dtype_note") else ""
        lines.append(f"dtype: {metrics['dtype']}{note}")
    if metrics.get("wna16_kernel"):
        lines.append(f"4-bit kernel: {metrics['wna16_kernel']}")
    if metrics.get("fallback"):
        lines.append(f"stand-in: {metrics['fallback']}")
    return lines


@handle_errors
def compare(model: str, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Results table of the latest version of every variant of MODEL."""
    from pipeline.render import console, print_json, results_table
    from pipeline.results import VariantOutcome, table_rows
    from registry import open_registry

    reg = open_registry(settings(registry))
    outcomes = []
    for view in reg.latest_versions(model):
        out = VariantOutcome(variant=view.variant, format=view.format, ref=view.ref, status=view.state,
                             size=view.size, bpw=(view.lineage.get("info") or {}).get("bpw"))
        for r in view.results:
            if r.status != "ok":
                out.eval_status, out.eval_error = r.status, r.error
                continue
            out.engine, out.engine_version, out.eval_status = r.engine, r.engine_version, "ok"
            if r.kind == "quality":
                out.quality = r.metrics
            elif r.kind == "speed":
                out.speed = r.metrics
        outcomes.append(out)
    rows = table_rows(outcomes)
    if as_json:
        print_json(rows)
        return
    console.print(results_table(model, rows))


@handle_errors
def pull(ref: Annotated[str, typer.Argument(help="MODEL/VARIANT[@VERSION]")],
         dest: Annotated[Path, typer.Argument(help="Folder to copy the files into.")],
         registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Copy a version's files out of the registry, verifying every sha256."""
    from pipeline.render import console, print_json
    from registry import open_registry

    paths = open_registry(settings(registry), create=False).pull(ref, dest)
    if as_json:
        print_json([str(p) for p in paths])
    else:
        for p in paths:
            console.print(f"[green]✓[/] {p}")


def register(app: typer.Typer) -> None:
    app.command()(models)
    app.command()(variants)
    app.command()(show)
    app.command()(compare)
    app.command()(pull)
