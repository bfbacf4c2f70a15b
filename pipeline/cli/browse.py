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
    from pipeline.shown import legend, pick
    from registry import open_registry

    view = open_registry(settings(registry)).get_version(ref)
    if as_json:
        print_json(show_json(view))
        return
    console.print(f"[bold]{view.ref}[/]  {view.format}  state={view.state}  created {view.created_at[:19]}")
    console.print(f"source: {view.source['identity']}")
    for f in view.files:
        console.print(f"  {f.name}  {f.size:,} B  sha256:{f.sha256}")
    picked = pick(view.format, view.results)
    marks: list[str] = []
    for r in view.results:
        line, keys = result_line(view.format, r, shown=r is picked.quality or r is picked.speed)
        marks += keys
        console.print(f"  {line}", markup=False)
        for note in computed_as(r.metrics):
            console.print(f"    [yellow]{note}[/]")
    for m in legend(marks):
        console.print(f"  {m.line}", markup=False)
    if picked.quality is not None:
        statistics_tables(picked.quality)
    console.print_json(data=view.lineage)


def statistics_tables(result: Any) -> None:
    """The shown quality result's statistics as ``llama-perplexity --kl-divergence`` prints them, and its KLD by
    the reference's confidence (nothing for a result without them)."""
    from rich.table import Table

    from pipeline.render import console
    from pipeline.shown import confidence_rows, llama_statistics

    lines = llama_statistics(result.metrics)
    if lines:
        table = Table(title=f"as llama-perplexity --kl-divergence prints them ({result.engine}; ± independent-token)")
        table.add_column("statistic")
        table.add_column("value", justify="right")
        for label, value in lines:
            table.add_row(label, value)
        console.print(table)
    bands = confidence_rows(result.metrics)
    if bands:
        table = Table(title="by the reference's confidence (its top token's probability)")
        for name in ("confidence", "positions", "mean KLD", "same top p"):
            table.add_column(name, justify="left" if name == "confidence" else "right")
        for b in bands:
            top = b.get("top1_agreement")
            table.add_row(str(b["band"]), str(b["n"]), f"{b['kld_mean']:.4g}" if b.get("kld_mean") is not None
                          else "—", f"{100 * top:.2f} %" if top is not None else "—")
        console.print(table)


def show_json(view: Any) -> dict[str, Any]:
    """``show --json``: the version as stored (full precision), each quality result with its ``kld_kind``
    and every result with its ``role`` to the format (pipeline.shown.role_of)."""
    from pipeline.results import kld_of
    from pipeline.shown import pick, role_of, second_role

    picked = pick(view.format, view.results)
    shown = {id(r) for r in (picked.quality, picked.speed) if r is not None}
    data = {**view.model_dump(mode="json"), "ref": view.ref}
    for r, out in zip(view.results, data["results"], strict=True):
        out["role"] = role_of(view.format, r.engine) if id(r) in shown else second_role(view.format, r.engine)
        if r.kind == "quality":
            out["kld_kind"] = kld_of(r.metrics).kind
    return data


def result_line(fmt: str, r: Any, shown: bool) -> tuple[str, list[str]]:
    """One result of ``show``, its numbers marked (pipeline.shown), and the mark keys it used."""
    from pipeline.render import fmt_number
    from pipeline.results import kld_of
    from pipeline.shown import DENSE_KERNEL, dense_kernel, engine_mark, kld_mark, kld_text, median, role_of, second_role

    role = role_of(fmt, r.engine) if shown else second_role(fmt, r.engine)
    mark = engine_mark(fmt, r.engine, role)
    head = f"result {r.kind} on {r.engine}{mark.symbol if mark else ''} ({r.engine_version}): {r.status}"
    keys = [mark.key] if mark else []
    m, parts = r.metrics, []
    if r.status == "ok" and r.kind == "quality":
        k = kld_of(m)
        dense = "§" if dense_kernel(m) else ""
        parts = [f"PPL {fmt_number(m.get('ppl'))}{dense}", f"ΔPPL {fmt_number(m.get('delta_ppl_pct'))}{dense} %",
                 f"KLD {kld_text(k, fmt_number) or '—'}{dense}", f"top-1 {fmt_number(100 * m['top1_agreement'])}"
                 f"{dense} %" if isinstance(m.get("top1_agreement"), int | float) else "top-1 —"]
        keys += [km.key] if (km := kld_mark(k)) else []
        keys += [DENSE_KERNEL.key] if dense else []
    elif r.status == "ok" and r.kind == "speed":
        dense = "§" if dense_kernel(m) else ""
        parts = [f"pp {fmt_number(median(m.get('prompt_tok_per_s')))}{dense} tok/s",
                 f"tg {fmt_number(median(m.get('decode_tok_per_s')))}{dense} tok/s"]
        keys += [DENSE_KERNEL.key] if dense else []
    elif r.status == "ok" and r.kind == "serving":
        parts, more = serving_parts(fmt, r)
        keys += more
    return head + ("  " + " · ".join(parts) if parts else ""), keys


def serving_parts(fmt: str, r: Any) -> tuple[list[str], list[str]]:
    """A serving result's figures for ``show``: load shape, p99 TTFT and output tok/s per level, memory."""
    from pipeline.render import fmt_number
    from pipeline.serving_summary import summarize

    s = summarize("", "", fmt, r)
    if s is None:
        return ["metrics are not a serving result of this Quantyard's schema"], []
    levels = ", ".join(f"{lv.concurrency} users: p99 TTFT {fmt_number(lv.ttft_p99_ms)} ms, "
                       f"{fmt_number(lv.output_throughput)} tok/s" + (f", {lv.failed} failed" if lv.failed else "")
                       for lv in s.levels)
    return [f"{s.server} {s.server_version}{s.symbols}", s.shape, levels, s.memory.text], list(s.marks)


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
    if metrics.get("kld_method"):
        lines.append(f"KLD: {metrics['kld_method']}")
    return lines


@handle_errors
def compare(model: str, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Results table of the latest version of every variant of MODEL."""
    from pipeline.render import console, print_json, results_table
    from pipeline.shown import table_rows
    from registry import open_registry

    reg = open_registry(settings(registry))
    views = reg.latest_versions(model)
    floors = reg.noise_floors({v.source["identity"] for v in views if v.source.get("identity")})
    rows = table_rows([outcome_of(view) for view in views], floors=floors)
    if as_json:
        print_json(rows)
        return
    console.print(results_table(model, rows))


def outcome_of(view: Any) -> Any:
    """A registered version as a results-table row: the format's own engine's results first, a stand-in's
    or another engine's only when it has none (pipeline.shown.pick), the others as cross-checks."""
    from pipeline.results import CrossCheck, VariantOutcome
    from pipeline.shown import pick

    out = VariantOutcome(variant=view.variant, format=view.format, ref=view.ref, status=view.state,
                         size=view.size, bpw=(view.lineage.get("info") or {}).get("bpw"))
    picked = pick(view.format, view.results)
    q, s = picked.quality, picked.speed
    if q is not None:
        out.quality, out.engine, out.engine_version, out.window_set_id = \
            q.metrics, q.engine, q.engine_version, q.window_set_id
    if s is not None:
        out.speed, out.speed_engine = s.metrics, s.engine
        if q is None:
            out.engine, out.engine_version = s.engine, s.engine_version
    out.cross_checks = [CrossCheck(engine=r.engine, engine_version=r.engine_version, window_set_id=r.window_set_id,
                                   quality=r.metrics) for _, r in picked.others]
    failed = [r for r in view.results if r.status != "ok" and r.kind in ("quality", "speed")]
    if q is not None or s is not None:
        out.eval_status = "ok"
    elif failed:
        out.eval_status, out.eval_error = failed[-1].status, failed[-1].error
    return out


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
