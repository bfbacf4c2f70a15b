"""Server-rendered pages: models index, model page (table + chart + serving charts), version page, compare page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from pipeline.errors import InvalidReferenceError
from pipeline.serving_summary import serving_summaries
from pipeline.shown import confidence_rows, engine_mark, llama_statistics, role_of, second_role
from pipeline.shown import pick as pick_results
from pipeline.specs import Ref
from registry.store import Registry
from registry.views import ArtifactView, VersionView
from registry.web.api import registry_of
from registry.web.cache import ResponseCache
from registry.web.chart import build_chart, format_colours
from registry.web.commands import commands, download_path
from registry.web.format import page_marks, sets_note
from registry.web.serving import build_serving_charts, shown_metrics
from registry.web.table import (
    METRICS,
    QUALITY_KEYS,
    Row,
    chart_floor,
    row_from_summary,
    row_from_version,
    sort_rows,
    with_floors,
)

router = APIRouter(include_in_schema=False)
Reg = Annotated[Registry, Depends(registry_of)]
MAX_COMPARE = 6
SORT_KEYS = frozenset({*METRICS, "variant", "format", "state", "engine", "memory"})


def templates(request: Request) -> Jinja2Templates:
    return request.app.state.templates


def cached(request: Request, reg: Registry, build: Callable[[], Response]) -> Response:
    cache: ResponseCache = request.app.state.cache
    return cache.respond(request, reg, build)


def render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    return templates(request).TemplateResponse(request, name, context, status_code=status)


@router.get("/", response_class=HTMLResponse)
def index(request: Request, reg: Reg, q: str | None = None, architecture: str | None = None,
          format: str | None = None) -> Response:
    return cached(request, reg, lambda: _index(request, reg, q, architecture, format))


def _index(request: Request, reg: Registry, q: str | None, architecture: str | None,
           format: str | None) -> HTMLResponse:
    everything = reg.list_models()
    shown = reg.list_models(architecture=architecture or None, format=format or None, query=q or None) \
        if (q or architecture or format) else everything
    return render(request, "index.html", models=shown, total=len(everything), q=q or "",
                  architecture=architecture or "", format=format or "",
                  architectures=sorted({m.architecture for m in everything if m.architecture}),
                  formats=sorted({f for m in everything for f in m.formats}))


@router.get("/models/{model:qmodel}", response_class=HTMLResponse)
def model_page(request: Request, reg: Reg, model: str, sort: str | None = None, dir: str = "asc",
               format: str | None = None) -> Response:
    sort = sort if sort in SORT_KEYS else None
    dir = "desc" if dir == "desc" else "asc"
    return cached(request, reg, lambda: _model_page(request, reg, model, sort, dir, format))


def _model_page(request: Request, reg: Registry, model: str, sort: str | None, dir: str,
                format: str | None) -> HTMLResponse:
    summaries = reg.variant_summaries(model)
    served = {s.ref: serving_summaries(s.variant, s.ref, s.format, s.results) for s in summaries}
    floors = reg.noise_floors({s.source["identity"] for s in summaries if s.source and s.source.get("identity")})
    all_rows = with_floors([row_from_summary(s, served[s.ref]) for s in summaries], floors)
    rows = [r for r in all_rows if not format or r.format == format]
    rows = sort_rows(rows, sort, descending=dir == "desc")
    serving = build_serving_charts([x for r in rows for x in served[r.ref]])
    sources = {s.source.get("identity"): s.source for s in summaries if s.source}
    window_sets = sorted({r.window_set_id for r in rows if r.window_set_id})
    return render(request, "model.html", model=model, rows=rows, chart=build_chart(rows, chart_floor(rows, floors)),
                  metrics=METRICS,
                  serving=serving,
                  sources=list(sources.values()), window_sets=window_sets, sets_note=sets_note(rows),
                  marks=page_marks(rows), sort=sort, dir=dir,
                  format=format or "", formats=sorted({r.format for r in all_rows}),
                  colours=format_colours([r.format for r in all_rows]),
                  architecture=next((m.architecture for m in reg.list_models(query=model) if m.name == model), None))


def _eval_artifacts(reg: Registry, versions: Sequence[VersionView]) -> dict[str, dict[str, ArtifactView]]:
    """Window set and reference artifacts of the sources, keyed by window-set id."""
    out: dict[str, dict[str, ArtifactView]] = {}
    for identity in {v.source["identity"] for v in versions}:
        for art in reg.list_source_artifacts(identity):
            ws = art.meta.get("id") if art.kind == "window_set" else art.meta.get("window_set_id")
            if art.kind in ("window_set", "reference") and ws:
                out.setdefault(str(ws), {})[art.kind] = art
    return out


@router.get("/versions/{ref:qref}", response_class=HTMLResponse)
def version_page(request: Request, reg: Reg, ref: str) -> Response:
    return cached(request, reg, lambda: _version_page(request, reg, ref))


def _version_page(request: Request, reg: Registry, ref: str) -> HTMLResponse:
    view = reg.get_version(ref)
    history = reg.list_versions(view.model, view.variant)
    aliases = reg.aliases(view.model, view.variant)
    by_version: dict[int, list[str]] = {}
    for name, number in aliases.items():
        by_version.setdefault(number, []).append(name)
    floors = reg.noise_floors([view.source["identity"]] if view.source.get("identity") else [])
    rows = with_floors([row_from_version(v, {a: v.number for a in by_version.get(v.number, [])})
                        for v in reversed(history)], floors)
    used = {r.window_set_id for r in view.results if r.window_set_id}
    evals = {ws: arts for ws, arts in _eval_artifacts(reg, [view]).items() if ws in used}
    (row,) = with_floors([row_from_version(view, {a: view.number for a in by_version.get(view.number, [])})], floors)
    picked = pick_results(view.format, view.results).quality
    quality = picked.metrics if picked is not None else {}
    return render(request, "version.html", view=view, lineage=reg.lineage(view.ref), history=rows,
                  statistics=llama_statistics(quality), confidence=confidence_rows(quality),
                  statistics_engine=picked.engine if picked is not None else None,
                  noise_floor=floors.get(row.reference_key or ""),
                  marks=page_marks([row, *rows]), roles=result_roles(view),
                  aliases=aliases, evals=evals, commands=commands(view, str(request.base_url)),
                  files=[(f, download_path(view.ref, f.name)) for f in view.files],
                  row=row, requested=ref, metrics=METRICS,
                  shown={r.id: shown_metrics(r.kind, r.metrics) for r in view.results},
                  serving=build_serving_charts(serving_summaries(view.variant, view.ref, view.format, view.results)))


@router.get("/api", response_class=HTMLResponse)
def api_reference(request: Request) -> HTMLResponse:
    """The JSON API's endpoints, rendered from the app's own OpenAPI schema (no CDN-hosted doc UI)."""
    schema = request.app.openapi()
    ops = [(method.upper(), path, op) for path, item in schema["paths"].items() for method, op in item.items()]
    return render(request, "api.html", operations=ops, version=schema["info"]["version"])


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, reg: Reg, ref: Annotated[list[str] | None, Query()] = None) -> Response:
    return cached(request, reg, lambda: _compare_page(request, reg, ref))


def _compare_page(request: Request, reg: Registry, ref: list[str] | None) -> HTMLResponse:
    refs = list(dict.fromkeys(r.strip() for r in (ref or []) if r.strip()))
    if not 2 <= len(refs) <= MAX_COMPARE:
        raise InvalidReferenceError(f"compare needs 2 to {MAX_COMPARE} different variants, got {len(refs)}",
                                    hint="tick 2 to 6 variants on a model page, then press Compare")
    rows: list[Row] = []
    served = []
    identities = set()
    for text in refs:
        view = reg.get_version(Ref.parse(text))
        rows.append(row_from_version(view))
        served += serving_summaries(view.variant, view.ref, view.format, view.results)
        identities.add(view.source.get("identity"))
    rows = with_floors(rows, reg.noise_floors([i for i in identities if i]))
    note = sets_note(rows)
    best = {key: _best(rows, key, lower, note is not None) for key, (_, lower) in METRICS.items()}
    return render(request, "compare.html", rows=rows, metrics=METRICS, best=best, sets_note=note,
                  serving=build_serving_charts(served),
                  marks=page_marks(rows), window_sets=sorted({r.window_set_id for r in rows if r.window_set_id}))


def _best(rows: Sequence[Row], key: str, lower: bool, mixed_sets: bool) -> str | None:
    """The ref of the best value of ``key``, or None: fewer than two values, quality figures from different
    window sets or references, or KLDs of different kinds (an exact value and a bound do not rank)."""
    have = [r for r in rows if r.value(key) is not None]
    if len(have) < 2 or (mixed_sets and key in QUALITY_KEYS):
        return None
    if key == "kld" and len({r.kld_shown.kind for r in have}) > 1:
        return None
    pick = min if lower else max
    return pick(have, key=lambda r: r.value(key)).ref


def result_roles(view: VersionView) -> dict[int, tuple[str, str | None]]:
    """Each result's role to the version's format and its marker's legend line (version page)."""
    picked = pick_results(view.format, view.results)
    shown = {id(r) for r in (picked.quality, picked.speed) if r is not None}
    out: dict[int, tuple[str, str | None]] = {}
    for r in view.results:
        role = role_of(view.format, r.engine) if id(r) in shown else second_role(view.format, r.engine)
        mark = engine_mark(view.format, r.engine, role)
        out[r.id] = (role, mark.line if mark else None)
    return out
