"""Registry commands of the ``quantyard`` CLI: ``registry upgrade|verify|gc``, ``alias``, ``state``,
``audit``, ``lineage`` and ``publish``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.cli.common import JsonOpt, handle_errors, settings

# The registry commands' own --registry help names the URI forms (the other commands' is shorter).
RegistryOpt = Annotated[str | None, typer.Option(
    "--registry", help="Registry folder or URI: sqlite:///PATH, postgresql://USER@HOST/DB "
                       "(default: $QUANTYARD_REGISTRY).")]
BlobsOpt = Annotated[str | None, typer.Option(
    "--blobs", help="Blob store URL: a folder or s3://bucket/prefix (default: $QUANTYARD_BLOBS, else the URL "
                    "recorded in the registry, else REGISTRY/blobs).")]
ByOpt = Annotated[str | None, typer.Option("--by", help="Who is acting, for the audit log (default: user@host).")]
NoteOpt = Annotated[str | None, typer.Option("--note", help="Why, for the audit log.")]
GraceOpt = Annotated[float, typer.Option(
    "--grace", help="Seconds an unreferenced blob or temp file may be in flight before it counts as an orphan.")]

registry_app = typer.Typer(no_args_is_help=True, help="Schema upgrades and integrity: upgrade, verify, gc.")
alias_app = typer.Typer(no_args_is_help=True, help="Movable names on versions (latest is automatic).")
state_app = typer.Typer(no_args_is_help=True, help="Version states: candidate → validated → published, "
                                                   "or → rejected / deprecated.")
lineage_app = typer.Typer(no_args_is_help=True, help="Where a version came from, and what was built from a source.")


def _open(registry: str | None, blobs: str | None = None, create: bool = False) -> Any:
    from registry import open_registry

    return open_registry(settings(registry, blobs=blobs), create=create)


def _print(data: Any, as_json: bool) -> bool:
    if as_json:
        from pipeline.render import print_json

        print_json(data)
    return as_json


# -- registry upgrade | verify | gc -----------------------------------------------------------------


@registry_app.command("upgrade")
@handle_errors
def upgrade_cmd(registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Migrate the registry's database schema to this Quantyard's version (creating it if empty)."""
    from pipeline.render import console
    from registry import upgrade_registry

    before, after = upgrade_registry(settings(registry))
    if not _print({"from": before, "to": after}, as_json):
        console.print(f"[green]✓[/] schema {before or 'empty'} → {after}" if before != after
                      else f"[green]✓[/] schema already at {after}")


@registry_app.command("verify")
@handle_errors
def verify_cmd(deep: Annotated[bool, typer.Option("--deep", help="Also re-hash every blob (reads all bytes).")]
               = False, grace: GraceOpt = 3600.0, registry: RegistryOpt = None, blobs: BlobsOpt = None,
               as_json: JsonOpt = False) -> None:
    """Check every blob the registry references (present, right size; --deep: right sha256) and find
    orphans. Exit 1 on any problem."""
    from pipeline.errors import EXIT_CHECK_FAILED
    from pipeline.render import console
    from registry.integrity import verify as verify_registry

    report = verify_registry(_open(registry, blobs), deep=deep, grace_s=grace)
    if not _print({**report.model_dump(), "ok": report.ok, "broken_versions": report.broken_versions}, as_json):
        console.print(f"checked {report.checked} blobs ({report.bytes_checked / 1e6:,.1f} MB"
                      f"{', re-hashed' if deep else ''}) in {report.blobs_url}")
        for p in report.problems:
            size = f" expected {p.expected_size} B, found {p.found_size} B" if p.problem != "orphan" else ""
            found = f" (actual sha256 {p.found_sha256})" if p.found_sha256 else ""
            console.print(f"[red]{p.problem}[/] {p.sha256}{size}{found}")
            for user in p.used_by:
                console.print(f"    used by {user}")
        if report.in_flight:
            console.print(f"{len(report.in_flight)} unreferenced blob(s)/temp file(s) younger than {grace:g} s "
                          "(writers in flight)")
        if report.broken_versions:
            console.print("[red]broken versions:[/] " + ", ".join(report.broken_versions))
        console.print("[green]✓ clean[/]" if report.ok else
                      f"[red]✗ {len(report.problems)} problem(s)[/]; orphans and stale temp files: "
                      "`quantyard registry gc`")
    if not report.ok:
        raise typer.Exit(EXIT_CHECK_FAILED)


@registry_app.command("gc")
@handle_errors
def gc_cmd(dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
           grace: GraceOpt = 3600.0, registry: RegistryOpt = None, blobs: BlobsOpt = None,
           as_json: JsonOpt = False) -> None:
    """Remove blobs no version references and temp files left by crashed writers (older than --grace)."""
    from pipeline.render import console
    from registry.integrity import gc as gc_registry

    report = gc_registry(_open(registry, blobs), dry_run=dry_run, grace_s=grace)
    if not _print(report.model_dump(), as_json):
        verb = "would remove" if dry_run else "removed"
        for sha in report.blobs:
            console.print(f"{verb} blob {sha}")
        for path in report.temp_files:
            console.print(f"{verb} temp file {path}")
        console.print(f"{verb} {len(report.blobs)} blob(s), {report.bytes / 1e6:,.1f} MB, "
                      f"{len(report.temp_files)} temp file(s), {len(report.blob_rows)} unreferenced blob row(s); "
                      f"kept {report.kept_young} younger than {grace:g} s")


# -- aliases, states, audit -----------------------------------------------------------------------


@alias_app.command("set")
@handle_errors
def alias_set(ref: Annotated[str, typer.Argument(help="MODEL/VARIANT@VERSION to point the alias at.")],
              name: Annotated[str, typer.Argument(help="Alias, e.g. production.")], by: ByOpt = None,
              note: NoteOpt = None, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Point alias NAME at a version (creates or moves it; logged)."""
    from pipeline.render import console

    view = _open(registry).set_alias(ref, name, by=by, note=note)
    if not _print({"alias": name, "ref": view.ref}, as_json):
        console.print(f"[green]✓[/] {view.model}/{view.variant}@{name} → {view.number}")


@alias_app.command("rm")
@handle_errors
def alias_rm(variant: Annotated[str, typer.Argument(help="MODEL/VARIANT")], name: str, by: ByOpt = None,
             note: NoteOpt = None, registry: RegistryOpt = None) -> None:
    """Remove alias NAME from MODEL/VARIANT (logged)."""
    from pipeline.render import console
    from pipeline.specs import Ref

    ref = Ref.parse(variant)
    _open(registry).delete_alias(ref.model, ref.variant, name, by=by, note=note)
    console.print(f"[green]✓[/] removed {ref.model}/{ref.variant}@{name}")


@alias_app.command("list")
@handle_errors
def alias_list(variant: Annotated[str, typer.Argument(help="MODEL/VARIANT")], registry: RegistryOpt = None,
               as_json: JsonOpt = False) -> None:
    """List the aliases of MODEL/VARIANT."""
    from pipeline.render import console
    from pipeline.specs import Ref

    ref = Ref.parse(variant)
    aliases = _open(registry).aliases(ref.model, ref.variant)
    if not _print(aliases, as_json):
        for name, number in aliases.items():
            console.print(f"{ref.model}/{ref.variant}@{name} → {number}")


@state_app.command("set")
@handle_errors
def state_set(ref: Annotated[str, typer.Argument(help="MODEL/VARIANT@VERSION")],
              state: Annotated[str, typer.Argument(help="validated | published | rejected | deprecated")],
              by: ByOpt = None, note: NoteOpt = None, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Move a version to STATE; illegal transitions are refused (exit 2)."""
    from pipeline.errors import InvalidSpecError
    from pipeline.render import console
    from pipeline.specs import VersionState

    try:
        target = VersionState(state)
    except ValueError:
        raise InvalidSpecError(f"unknown state {state!r}", hint="one of: " + ", ".join(VersionState)) from None
    view = _open(registry).set_state(ref, target, by=by, note=note)
    if not _print({"ref": view.ref, "state": view.state}, as_json):
        console.print(f"[green]✓[/] {view.ref} is {view.state}")


@handle_errors
def audit(model: Annotated[str | None, typer.Argument(help="Only this model (default: every model).")] = None,
          variant: Annotated[str | None, typer.Option(help="Only this variant of MODEL.")] = None,
          limit: Annotated[int, typer.Option(help="Newest N events.")] = 50, registry: RegistryOpt = None,
          as_json: JsonOpt = False) -> None:
    """The audit log: registrations, alias moves and state changes (who, when, from, to), newest first."""
    from rich.table import Table

    from pipeline.render import console

    events = _open(registry).audit_log(model, variant, limit=limit)
    if _print([e.model_dump() for e in events], as_json):
        return
    table = Table("when", "who", "what", "version", "alias", "from", "to", "note", header_style="bold")
    for e in events:
        table.add_row(e.at[:19], e.actor, e.action, f"{e.model}/{e.variant}@{e.version or '—'}", e.name or "",
                      e.old or "", e.new or "", e.note or "")
    console.print(table)


# -- lineage --------------------------------------------------------------------------------------


@lineage_app.command("show")
@handle_errors
def lineage_show(ref: Annotated[str, typer.Argument(help="MODEL/VARIANT[@VERSION|@ALIAS]")],
                 registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Upstream: the source commit (or content hash), tool, environment and inputs of a version."""
    from pipeline.render import console

    view = _open(registry).lineage(ref)
    if _print(view.model_dump(), as_json):
        return
    console.print(f"[bold]{view.ref}[/]  build {view.build_key[:16]}")
    console.print(f"source: {view.source.get('identity')}  commit={view.source.get('commit') or '—'}")
    for i in view.inputs:
        console.print(f"  {i.kind}: {i.name or ''} {i.ref}")
    console.print_json(data={"tool": view.tool, "parameters": view.parameters, "environment": view.environment})


@lineage_app.command("derived")
@handle_errors
def lineage_derived(query: Annotated[str, typer.Argument(
                        help="A source identity (hub:OWNER/NAME@COMMIT, local:sha256:…), a tool reference or an "
                             "input's sha256; prefixes of 8+ characters match.")],
                    kind: Annotated[str | None, typer.Option(help="source | tool | calibration | imatrix | …")]
                    = None, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Downstream: every version built from a source, a tool, or an input file."""
    from pipeline.render import console

    views = _open(registry).derived_from(query, kind=kind)
    if _print([{"ref": v.ref, "state": v.state, "source": v.source["identity"]} for v in views], as_json):
        return
    for v in views:
        console.print(f"{v.ref}  {v.state}  from {v.source['identity']}")


# -- publish --------------------------------------------------------------------------------------


@handle_errors
def publish(refs: Annotated[list[str], typer.Argument(help="MODEL/VARIANT[@VERSION] of one model and format.")],
            repo: Annotated[str, typer.Option("--repo", help="Hub repo OWNER/NAME.")],
            private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
            dry_run: Annotated[bool, typer.Option("--dry-run", help="Write the commit operations and the card to "
                                                  "--out instead of uploading.")] = False,
            out: Annotated[Path | None, typer.Option(help="Dry-run folder (default ./publish-OWNER--NAME).")] = None,
            base_model: Annotated[str | None, typer.Option(help="Hub id of the unquantized model (default: the "
                                                           "source's repo id).")] = None,
            split_mb: Annotated[int, typer.Option(help="Split GGUF files larger than this many MB.")] = 48_000,
            by: ByOpt = None, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Publish versions to the Hugging Face Hub with a model card (metrics, lineage, base_model)."""
    from pipeline.llama_cpp import llama_cpp_toolchain
    from pipeline.render import console
    from registry.publish import GGUFSplitter, PublishRequest
    from registry.publish import publish as run_publish

    req = PublishRequest(refs=refs, repo_id=repo, private=private, dry_run=dry_run, base_model=base_model,
                         out_dir=out or Path(f"publish-{repo.replace('/', '--')}"), split_mb=split_mb, by=by,
                         splitter=GGUFSplitter(llama_cpp_toolchain(settings(registry))))
    result = run_publish(_open(registry), req)
    if _print({"repo_id": result.repo_id, "dry_run": dry_run, "out_dir": str(result.out_dir or ""),
               "commits": result.commits, "operations": result.operations, "warnings": result.warnings}, as_json):
        return
    for op in result.operations:
        console.print(f"  {op['revision'] or 'main'}:{op['path_in_repo']}  {op['size']:,} B  {op['sha256'][:16]}")
    for w in result.warnings:
        console.print(f"[yellow]warning[/]: {w}")
    console.print(f"[green]✓[/] dry run written to {result.out_dir}" if dry_run
                  else "[green]✓[/] published: " + ", ".join(result.commits))


def register(app: typer.Typer) -> None:
    """Add the registry commands to the main ``quantyard`` app."""
    app.add_typer(registry_app, name="registry")
    app.add_typer(alias_app, name="alias")
    app.add_typer(state_app, name="state")
    app.add_typer(lineage_app, name="lineage")
    app.command("audit")(audit)
    app.command("publish")(publish)
