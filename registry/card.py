"""The Hugging Face model card of a publication, built with ``huggingface_hub.ModelCard``.

It states what a user needs to trust the files: the metrics table (PPL, KLD, top-1 agreement and
speed, with the window set and the engine versions that measured them), the lineage (source commit
or content hash, tools and versions, build keys), the calibration and imatrix files, and the
``base_model`` metadata the Hub uses to link quantizations to their model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from pipeline.formats import format_info
from registry.views import ArtifactView, VersionView

TEMPLATE = (Path(__file__).parent / "card_template.md").read_text(encoding="utf-8")


def _fmt(x: Any, nd: int, scale: float = 1.0) -> str:
    return "—" if not isinstance(x, int | float) else f"{x * scale:.{nd}f}"


def _median(x: Any) -> Any:
    return x.get("median") if isinstance(x, dict) else x


def _metric_row(view: VersionView) -> dict[str, Any]:
    q = next((r for r in view.results if r.kind == "quality" and r.status == "ok"), None)
    s = next((r for r in view.results if r.kind == "speed" and r.status == "ok"), None)
    qm, sm = (q.metrics if q else {}), (s.metrics if s else {})
    se = qm.get("ppl_ci95_high")
    ppl = _fmt(qm.get("ppl"), 4) + (f" (95% CI ≤ {se:.4f})" if isinstance(se, float) else "")
    engine = next((f"{r.engine} {r.engine_version or ''}".strip() for r in (q, s) if r is not None), "—")
    return {"variant": view.variant, "bpw": _fmt((view.lineage.get("info") or {}).get("bpw"), 3), "ppl": ppl,
            "delta": _fmt(qm.get("delta_ppl_pct"), 3), "kld": _fmt(qm.get("kld_mean"), 6),
            "top1": _fmt(qm.get("top1_agreement"), 2, 100.0), "pp": _fmt(_median(sm.get("prompt_tok_per_s")), 1),
            "tg": _fmt(_median(sm.get("decode_tok_per_s")), 1), "engine": engine}


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


def build_card(views: list[VersionView], *, repo_id: str, base_model: str | None, files: list[dict[str, Any]],
               inputs: list[dict[str, Any]], window_sets: list[ArtifactView],
               references: list[ArtifactView]) -> ModelCard:
    """The model card for ``views`` published to ``repo_id``; ``files`` are the uploaded files."""
    fmt = views[0].format
    data = ModelCardData(
        base_model=base_model, base_model_relation="quantized" if base_model else None,
        library_name=format_info(fmt).library_name,
        pipeline_tag="text-generation", tags=["quantyard", fmt, "quantized"])
    ws_ids = {r.window_set_id for v in views for r in v.results if r.window_set_id}
    src = views[0].source
    base = base_model or src.get("repo_id") or f"the local checkpoint `{src['identity']}`"
    engines = sorted({f"{r.engine} {r.engine_version}" for v in views for r in v.results if r.engine_version})
    summary = (f"{fmt.upper()} quantizations of {base}, made, evaluated and registered with Quantyard "
               f"({len(views)} variant{'s' if len(views) != 1 else ''}).")
    top_k = next((a.meta.get("top_k") for a in references if a.meta.get("top_k")), 32)
    return ModelCard.from_template(
        data, template_str=TEMPLATE, title=repo_id.split("/")[-1], summary=summary, files=files,
        metrics=[_metric_row(v) for v in views], top_k=top_k,
        window_sets=[{**a.meta, "origin": a.meta.get("origin", "—")} for a in window_sets
                     if a.meta.get("id") in ws_ids],
        references=[{"engine_version": a.meta.get("engine_version", "—"), "ppl": _fmt(a.meta.get("ppl"), 4),
                     "window_set_id": a.meta.get("window_set_id", "—")} for a in references
                    if a.meta.get("window_set_id") in ws_ids],
        engines=engines, hardware=_hardware(views), source=src, lineage=[_lineage_row(v) for v in views],
        inputs=inputs)
