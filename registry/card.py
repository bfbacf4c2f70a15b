"""The Hugging Face model card of a publication, built with ``huggingface_hub.ModelCard``.

It states what a user needs to trust the files: the metrics table (PPL, KLD, top-1 agreement and
speed, with the window set and the engine versions that measured them; the format's own engine's figures,
a cross-check as a second row, and a marker with a legend line on every number that is not what its
header says: a stand-in engine, a KLD bound or estimate, a speed measured with a replaced kernel), the
lineage (source commit or content hash, tools and versions, build keys), the calibration and imatrix files, and the
``base_model`` metadata the Hub uses to link quantizations to their model. Serving results, where a variant was
served and load-tested, get a section of their own: every level's TTFT / ITL percentiles and output tok/s, the
measured memory with its context and users, the load shape (``¶`` when CPU-scaled) and ``§`` when vLLM's 4-bit
kernel was replaced.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from pipeline.formats import format_info
from pipeline.results import kld_of
from pipeline.serving_summary import ServingSummary, serving_summaries
from pipeline.shown import (
    DENSE_KERNEL,
    dense_kernel,
    engine_mark,
    eval_sets_note,
    kld_mark,
    kld_text,
    legend,
    llama_statistics,
    median,
    pick,
    role_of,
)
from registry.views import ArtifactView, ResultView, VersionView

TEMPLATE = (Path(__file__).parent / "card_template.md").read_text(encoding="utf-8")


def _fmt(x: Any, nd: int, scale: float = 1.0) -> str:
    return "—" if not isinstance(x, int | float) else f"{x * scale:.{nd}f}"


def _kld(x: float) -> str:
    return _fmt(x, 6)


def _metric_rows(view: VersionView) -> tuple[list[dict[str, Any]], list[str]]:
    """The card's row of one version, its second figures, and the mark keys they use: the format's own
    engine's results first (pipeline.shown.pick), every number that is not what its header says marked."""
    picked = pick(view.format, view.results)
    q, s = picked.quality, picked.speed
    qm, sm = (q.metrics if q else {}), (s.metrics if s else {})
    dense = DENSE_KERNEL.symbol if dense_kernel(sm) else ""
    dense_q = DENSE_KERNEL.symbol if dense_kernel(qm) else ""
    role = role_of(view.format, q.engine if q else s.engine if s else None)
    engine = next((r for r in (q, s) if r is not None), None)
    marks = [m.key for m in (engine_mark(view.format, engine.engine if engine else None, role),
                             kld_mark(kld_of(qm)), DENSE_KERNEL if dense or dense_q else None) if m is not None]
    row = {"variant": view.variant, "bpw": _fmt((view.lineage.get("info") or {}).get("bpw"), 3),
           **_quality_cells(qm, dense_q), "pp": _speed(sm.get("prompt_tok_per_s"), dense),
           "tg": _speed(sm.get("decode_tok_per_s"), dense), "engine": _engine(view.format, engine, role)}
    rows = [row]
    for second, r in picked.others:
        mark = engine_mark(view.format, r.engine, second)
        marks += [m.key for m in (mark, kld_mark(kld_of(r.metrics))) if m is not None]
        rows.append({"variant": f"{view.variant} ({second})", "bpw": "—", **_quality_cells(r.metrics), "pp": "—",
                     "tg": "—", "engine": _engine(view.format, r, second)})
    return rows, marks


def _quality_cells(m: dict[str, Any], dense: str = "") -> dict[str, str]:
    """``dense``: the dense-kernel mark when a stand-in for vLLM's 4-bit kernel computed these figures."""
    lo, hi = m.get("ppl_ci95_low"), m.get("ppl_ci95_high")
    ci = f" (95% CI {lo:.4f}–{hi:.4f})" if isinstance(lo, float) and isinstance(hi, float) else ""
    cells = {"ppl": _fmt(m.get("ppl"), 4) + ci, "delta": _fmt(m.get("delta_ppl_pct"), 3),
             "kld": kld_text(kld_of(m), _kld) or "—", "top1": _fmt(m.get("top1_agreement"), 2, 100.0)}
    return {k: v + dense if v != "—" else v for k, v in cells.items()}


def _speed(x: Any, dense: str) -> str:
    text = _fmt(median(x), 1)
    return text + dense if text != "—" else text


def _engine(fmt: str, r: ResultView | None, role: str) -> str:
    if r is None:
        return "—"
    mark = engine_mark(fmt, r.engine, role)
    return f"{r.engine} {r.engine_version or ''}".strip() + (_md(mark.symbol) if mark else "")


def _md(text: str) -> str:
    """A marker in Markdown: ``*`` would start emphasis or a list item."""
    return text.replace("*", "\\*")


def _sets_note(views: list[VersionView]) -> str | None:
    figures = []
    for v in views:
        q = pick(v.format, v.results).quality
        if q is not None:
            figures.append((v.variant, q.window_set_id, q.metrics.get("reference_key")))
    return eval_sets_note(figures)


def _serving_rows(views: list[VersionView]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The serving table's rows (one per load level), the mark keys they use, and one note per load shape."""
    rows: list[dict[str, Any]] = []
    marks: list[str] = []
    notes: list[str] = []
    for v in views:
        for s in serving_summaries(v.variant, v.ref, v.format, v.results):
            marks += s.marks
            note = f"{s.shape}" + (f": {s.profile_note}" if s.profile_note else "")
            if note not in notes:
                notes.append(note)
            rows += _level_rows(s)
    return rows, marks, notes


def _level_rows(s: ServingSummary) -> list[dict[str, Any]]:
    server = f"{s.server} {s.server_version}" + _md(s.symbols)
    return [{"variant": s.variant, "server": server if i == 0 else "", "profile": s.profile if i == 0 else "",
             "users": lv.concurrency, "ttft": f"{_fmt(lv.ttft_p50_ms, 0)} / {_fmt(lv.ttft_p99_ms, 0)}",
             "itl": f"{_fmt(lv.itl_p50_ms, 1)} / {_fmt(lv.itl_p99_ms, 1)}", "tok_s": _fmt(lv.output_throughput, 1),
             "failed": f"{lv.failed}/{lv.requests}",
             "memory": f"{s.memory.text} ({s.memory.what})" if i == 0 else ""} for i, lv in enumerate(s.levels)]


def _hardware(views: list[VersionView]) -> list[str]:
    out = []
    for v in views:
        for r in v.results:
            if r.kind == "speed" and r.hardware:
                text = ", ".join(f"{k}={r.hardware[k]}" for k in sorted(r.hardware))
                if text not in out:
                    out.append(text)
    return out


def _lineage_row(view: VersionView) -> dict[str, Any]:
    lin = view.lineage
    tool = lin.get("tool") or {}
    return {"ref": view.ref, "state": view.state, "build_key": view.build_key[:16],
            "tool": ", ".join(f"{k}={v}" for k, v in tool.items()) or "—",
            "parameters": ", ".join(f"{k}={v}" for k, v in (lin.get("parameters") or {}).items()) or "—",
            "built_at": lin.get("built_at", "—"), "quantyard": lin.get("quantyard_version", "—")}


def _floor_line(meta: dict[str, Any]) -> str:
    """A noise floor (flows/steps.py ``ensure_noise_floor``) as one line of the card."""
    def g(x: Any) -> str:
        return f"{x:.3g}" if isinstance(x, int | float) else "—"

    low, high = meta.get("kld_ci95_low"), meta.get("kld_ci95_high")
    ci = f" (95 % CI {g(low)}–{g(high)})" if low is not None and high is not None else ""
    return (f"KLD {g(meta.get('kld_mean'))}{ci}, 99 % {g(meta.get('kld_p99'))}: {meta.get('reason')} "
            f"({meta.get('engine_version') or 'version unknown'})")


def _statistics(views: list[VersionView]) -> dict[str, Any]:
    """llama-perplexity's statistics of each variant's shown quality result: {"variants": [...], "rows": [(label,
    value per variant)]}; empty when no variant has them."""
    per = {v.variant: dict(llama_statistics(q.metrics)) for v in views
           if (q := pick(v.format, v.results).quality) is not None}
    per = {k: s for k, s in per.items() if s}
    if not per:
        return {}
    labels = list(dict.fromkeys(label for s in per.values() for label in s))
    return {"variants": list(per), "rows": [(label, [per[v].get(label, "—") for v in per]) for label in labels]}


def build_card(views: list[VersionView], *, repo_id: str, base_model: str | None, files: list[dict[str, Any]],
               inputs: list[dict[str, Any]], window_sets: list[ArtifactView],
               references: list[ArtifactView], noise_floors: Sequence[ArtifactView] = ()) -> ModelCard:
    """The model card for ``views`` published to ``repo_id``; ``files`` are the uploaded files."""
    fmt = views[0].format
    data = ModelCardData(
        base_model=base_model, base_model_relation="quantized" if base_model else None,
        library_name=format_info(fmt).library_name,
        pipeline_tag="text-generation", tags=["quantyard", fmt, "quantized"])
    ws_ids = {r.window_set_id for v in views for r in v.results if r.window_set_id}
    ref_keys = {r.metrics.get("reference_key") for v in views for r in v.results if r.kind == "quality"}
    src = views[0].source
    base = base_model or src.get("repo_id") or f"the local checkpoint `{src['identity']}`"
    engines = sorted({f"{r.engine} {r.engine_version}" for v in views for r in v.results if r.engine_version})
    summary = (f"{fmt.upper()} quantizations of {base}, made, evaluated and registered with Quantyard "
               f"({len(views)} variant{'s' if len(views) != 1 else ''}).")
    built = [_metric_rows(v) for v in views]
    serving, serving_marks, serving_notes = _serving_rows(views)
    statistics = _statistics(views)
    return ModelCard.from_template(
        data, template_str=TEMPLATE, title=repo_id.split("/")[-1], summary=summary, files=files,
        metrics=[row for rows, _ in built for row in rows],
        marks=[_md(m.line) for m in legend(k for _, keys in built for k in keys)], sets_note=_sets_note(views),
        serving=serving, serving_notes=serving_notes, serving_marks=[_md(m.line) for m in legend(serving_marks)],
        statistics=statistics,
        window_sets=[{**a.meta, "origin": a.meta.get("origin", "—")} for a in window_sets
                     if a.meta.get("id") in ws_ids],
        references=[{"engine_version": a.meta.get("engine_version", "—"), "ppl": _fmt(a.meta.get("ppl"), 4),
                     "window_set_id": a.meta.get("window_set_id", "—")} for a in references
                    if a.meta.get("window_set_id") in ws_ids],
        noise_floors=[_floor_line(a.meta) for a in noise_floors if a.meta.get("reference_key") in ref_keys
                      and a.meta.get("kld_mean") is not None],
        engines=engines, hardware=_hardware(views), source=src, lineage=[_lineage_row(v) for v in views],
        inputs=inputs)
