"""``quantyard recommend``: which variants of a model fit a memory budget, a context and a number of users, from
the registry's measured serving and quality results (registry/recommend.py says how they are judged)."""

from __future__ import annotations

import re
from typing import Annotated, Any

import typer

from pipeline.cli.common import JsonOpt, RegistryOpt, handle_errors, settings
from pipeline.errors import EXIT_CHECK_FAILED, InvalidSpecError

#: Units of ``--max-memory``: decimal (as the registry prints sizes) and binary.
UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
         "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``8G`` / ``8GB`` → 8 × 10^9, ``7.5GiB`` → 7.5 × 2^30, ``512M``, ``1000000`` (bytes).

    Raises:
        InvalidSpecError: not a positive size with a known unit.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in UNITS or float(m.group(1)) <= 0:
        raise InvalidSpecError(f"--max-memory {text!r} is not a size",
                               hint="e.g. 8G or 8GB (10^9 bytes), 7.5GiB (2^30 bytes), 512M, or plain bytes")
    return int(float(m.group(1)) * UNITS[unit])


@handle_errors
def recommend(
    model: Annotated[str, typer.Argument(help="MODEL in the registry.")],
    max_memory: Annotated[str, typer.Option("--max-memory", help="Memory budget: 8G (10^9 B), 7.5GiB (2^30 B)…")],
    context: Annotated[int | None, typer.Option(
        help="Context per user, in tokens (default: the context the model was trained for, read from its "
             "registered files and said in the output).", min=1)] = None,
    users: Annotated[int, typer.Option(help="Concurrent users.", min=1)] = 1,
    max_kld: Annotated[float | None, typer.Option(help="Largest exact full-vocabulary KLD accepted (a top-K "
                                                  "lower bound is not accepted).", min=0)] = None,
    p99_ttft_ms: Annotated[float | None, typer.Option(help="Largest p99 time to first token, ms.", min=0)] = None,
    p99_itl_ms: Annotated[float | None, typer.Option(help="Largest p99 inter-token latency, ms.", min=0)] = None,
    allow_estimates: Annotated[bool, typer.Option(help="Rank candidates measured at a smaller context on an "
                                                  "estimate of their memory (labelled ESTIMATE).")] = False,
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Rank the variants of MODEL that fit, by measured KLD, peak memory and throughput; say why each other one
    does not. Exit 1 when none fits."""
    from registry import open_registry
    from registry.recommend import RecommendRequest, recommendation_json
    from registry.recommend import recommend as run

    reg = open_registry(settings(registry), create=False)
    versions = reg.latest_versions(model)
    said = None
    if context is None:
        context, said = trained_context(reg, versions)
    req = RecommendRequest(model=model, max_memory_bytes=parse_bytes(max_memory), context=context, users=users,
                           max_kld=max_kld, p99_ttft_ms=p99_ttft_ms, p99_itl_ms=p99_itl_ms,
                           allow_estimates=allow_estimates)
    rec = run(versions, req)
    if said is not None:
        from pipeline.render import err_console

        err_console.print(f"note: context {context:,} tokens: {said} (--context to choose another)", markup=False)
    if as_json:
        from pipeline.render import print_json

        print_json(recommendation_json(rec))
    else:
        print_recommendation(rec)
    if not rec.ranked and not rec.unranked:
        raise typer.Exit(EXIT_CHECK_FAILED)


def trained_context(reg: Any, versions: list[Any]) -> tuple[int, str]:
    """The context the model was trained for, from its registered files: a folder format's ``config.json``
    (``max_position_embeddings`` and the other keys converters/checkpoint.py reads), else a GGUF's
    ``<architecture>.context_length``; and where it was read.

    Raises:
        InvalidSpecError: no registered file says it.
    """
    import json

    from converters.checkpoint import CONTEXT_KEYS

    for v in versions:
        for f in v.files:
            if f.name == "config.json":
                cfg = json.loads(reg.local_blob(f.sha256, f.size).read_text())
                cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
                key = next((k for k in CONTEXT_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 0), None)
                if key is not None:
                    return int(cfg[key]), f"the model's trained context ({v.ref} config.json {key})"
    from converters.gguf.header import read_header

    for v in versions:
        gguf = next((f for f in v.files if f.name.endswith(".gguf")), None)
        if gguf is None:
            continue
        header = read_header(reg.local_blob(gguf.sha256, gguf.size))
        arch = header.get("general.architecture")
        length = header.get(f"{arch}.context_length")
        if isinstance(length, int) and length > 0:
            return length, f"the model's trained context ({v.ref} {arch}.context_length)"
    raise InvalidSpecError("no registered file of this model says the context it was trained for",
                           hint="pass --context TOKENS")


def _cells(c: Any) -> list[str]:
    from pipeline.render import fmt_number
    from pipeline.serving_summary import gigabytes

    peak = "—" if c.peak_bytes is None else gigabytes(c.peak_bytes) + (" (ESTIMATE)" if c.peak_is_estimate else "")
    return [str(c.rank) if c.rank else "—", c.variant, c.engine or "—", fmt_number(c.kld), peak,
            f"{c.measured_context:,} × {c.measured_users}" if c.measured_context and c.measured_users else "—",
            str(c.level_users or "—"), fmt_number(c.p99_ttft_ms), fmt_number(c.p99_itl_ms), fmt_number(c.output_tok_s)]


def print_recommendation(rec: Any) -> None:
    """The ranked table, the unranked survivors and every exclusion with its reasons."""
    from rich.table import Table

    from pipeline.render import console

    r = rec.request
    title = (f"recommend {r.model}: ≤ {r.max_memory_bytes / 1e9:.3g} GB, context {r.context:,}, {r.users} users"
             + (f", KLD ≤ {r.max_kld:g}" if r.max_kld is not None else "")
             + (f", p99 TTFT ≤ {r.p99_ttft_ms:g} ms" if r.p99_ttft_ms is not None else "")
             + (f", p99 ITL ≤ {r.p99_itl_ms:g} ms" if r.p99_itl_ms is not None else ""))
    table = Table("rank", "variant", "engine", "KLD", "peak memory", "measured at ctx × users", "level users",
                  "p99 TTFT ms", "p99 ITL ms", "out tok/s", title=title, header_style="bold",
                  caption="rank 1 = Pareto front on (exact KLD ↓, peak memory ↓, output tok/s ↑)",
                  caption_justify="left")
    for c in [*rec.ranked, *rec.unranked]:
        table.add_row(*_cells(c))
    console.print(table)
    for c in [*rec.ranked, *rec.unranked]:
        for note in c.notes:
            console.print(f"  {c.name}: {note}", markup=False)
    if not rec.ranked and not rec.unranked:
        console.print("[red]no variant fits[/]")
    for c in rec.excluded:
        console.print(f"  [yellow]excluded[/] {c.name}: " + "; ".join(c.reasons), highlight=False)
    for note in rec.notes:
        console.print(f"  note: {note}", markup=False)


def register(app: typer.Typer) -> None:
    app.command()(recommend)
