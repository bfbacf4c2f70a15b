"""The comparison table: one row per variant version, with every metric on one scale and, where a
metric is missing, the reason (not evaluated, evaluation failed, engine unavailable).

Generic over formats and engines: a row shows the quality and speed results that
:func:`pipeline.shown.pick` chooses, the format's own engine (FORMATS) first and a stand-in's only when
it has none, labelled; other engines' quality results ride along as ``cross_checks``, never in the
engine's place. ``kld`` is only ever the exact full-vocabulary KLD: a top-K bound is ``kld_lower_bound``,
an estimate ``kld_estimate`` (:func:`pipeline.shown.quality_fields`); the page shows whichever is set, marked.
Serving results are never a row's quality or speed: they give the ``memory_*`` columns, from the newest serving
result of the format's own engine first (:func:`pipeline.serving_summary.serving_summaries`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, Field

from pipeline.results import KLDValue
from pipeline.serving_summary import ServingSummary, serving_summaries
from pipeline.shown import (
    WITHIN_FLOOR,
    dense_kernel,
    median,
    pick,
    quality_fields,
    role_of,
    row_marks,
    shown_kld,
    within_floor,
)
from registry.views import ResultView, VariantSummary, VersionView

NOT_EVALUATED = "not evaluated"
NOT_SERVED = "no serving result"
EVAL_FAILED = "evaluation failed"
ENGINE_UNAVAILABLE = "engine unavailable"

#: Result statuses and error types that mean "the engine could not run here", not "the quant is bad".
UNAVAILABLE_STATUSES = frozenset({"unavailable", "skipped"})
UNAVAILABLE_ERRORS = ("ToolchainMissingError", "EngineUnavailableError")

#: Sortable numeric columns: key -> (header, lower is better).
METRICS: dict[str, tuple[str, bool]] = {
    "size": ("size", True), "bpw": ("bpw", True), "ppl": ("PPL", True), "delta_ppl_pct": ("ΔPPL %", True),
    "kld": ("KLD", True), "kld_p99": ("KLD p99", True), "top1_pct": ("top-1 %", False),
    "pp_tok_s": ("prompt tok/s", False), "tg_tok_s": ("decode tok/s", False),
}
QUALITY_KEYS = ("ppl", "delta_ppl_pct", "kld", "kld_p99", "top1_pct")
SPEED_KEYS = ("pp_tok_s", "tg_tok_s")


class SecondFigure(BaseModel):
    """Another engine's quality result on the same version, shown beside the row's (``role`` cross-check,
    or a stand-in beside the engine's own)."""

    engine: str
    engine_version: str | None = None
    role: str
    window_set_id: str | None = None
    reference_key: str | None = None
    ppl: float | None = None
    delta_ppl_pct: float | None = None
    kld: float | None = None
    kld_lower_bound: float | None = None
    kld_estimate: float | None = None
    kld_kind: str | None = None
    kld_method: str | None = None
    top1_pct: float | None = None


class Row(BaseModel):
    """One variant version in the comparison table (also the JSON API's ``table`` rows)."""

    ref: str
    model: str
    variant: str
    version: int | None
    format: str
    quant: str  # type (GGUF), bits per weight (EXL2), bits/group (AWQ)...
    state: str | None
    aliases: dict[str, int] = Field(default_factory=dict)
    size: int | None = None
    bpw: float | None = None
    ppl: float | None = None
    ppl_se: float | None = None
    ppl_ci95_low: float | None = None
    ppl_ci95_high: float | None = None
    ref_ppl: float | None = None
    delta_ppl_pct: float | None = None
    delta_ppl_pct_ci95_low: float | None = None
    delta_ppl_pct_ci95_high: float | None = None
    kld: float | None = None  # the exact full-vocabulary KLD only
    kld_lower_bound: float | None = None
    kld_estimate: float | None = None
    kld_kind: str | None = None  # exact | lower_bound | estimate
    kld_method: str | None = None
    kld_ci95_low: float | None = None
    kld_ci95_high: float | None = None
    kld_p99: float | None = None  # the exact KLD's 99th percentile over scored positions (llama-perplexity's 99 %)
    #: The exact KLD is within the noise floor of its reference (pipeline.shown.within_floor): marked ≃.
    within_noise_floor: bool = False
    top1_pct: float | None = None
    ci_method: str | None = None
    n_windows: int | None = None
    pp_tok_s: float | None = None
    tg_tok_s: float | None = None
    speed_kernel: str | None = None  # the dense-matmul stand-in for vLLM's 4-bit kernel that measured the speed
    quality_kernel: str | None = None  # the same, where it computed the quality figures
    engine: str | None = None
    engine_version: str | None = None
    engine_role: str = "engine"  # engine | stand-in | cross-check | other (pipeline.shown.role_of)
    speed_engine: str | None = None
    window_set_id: str | None = None
    reference_key: str | None = None
    cross_checks: list[SecondFigure] = Field(default_factory=list)
    marks: list[str] = Field(default_factory=list)  # pipeline.shown.mark_of keys
    quality_reason: str | None = None  # why the quality metrics are missing
    quality_error: str | None = None
    speed_reason: str | None = None
    speed_error: str | None = None
    # measured memory of the newest serving result (pipeline.serving_summary.MemorySummary): the peak (device on a
    # GPU, else the server's RSS) at ``memory_context`` tokens per request with ``memory_users`` concurrent users
    memory_peak_bytes: int | None = None
    memory_source: str | None = None  # device | rss
    memory_context: int | None = None
    memory_users: int | None = None
    memory_engine: str | None = None
    memory_profile: str | None = None  # the load profile's name (cpu-scaled is marked)
    memory_kernel: str | None = None  # vLLM's 4-bit kernel replaced by a dense matmul while it was measured

    @property
    def kld_shown(self) -> KLDValue:
        """The row's one KLD (exact, lower bound or estimate) with its kind."""
        return shown_kld(self)

    def value(self, key: str) -> Any:
        """A column's value: ``kld`` is the KLD shown (exact, bound or estimate), ``memory`` the measured serving
        peak, anything else the field."""
        if key == "memory":
            return self.memory_peak_bytes
        return self.kld_shown.value if key == "kld" else getattr(self, key)

    def reason(self, key: str) -> str | None:
        """Why ``key`` has no value (None when it has one)."""
        if self.value(key) is not None:
            return None
        if key in QUALITY_KEYS:
            return self.quality_reason or "not reported"
        if key in SPEED_KEYS:
            return self.speed_reason or "not reported"
        if key == "memory":
            return NOT_SERVED if self.memory_engine is None else "peak memory not measured"
        return "not recorded"


def quant_label(fmt: str, spec: dict[str, Any]) -> str:
    """What distinguishes variants of one format: the GGUF type, EXL2 bpw, AWQ bits and group size."""
    if "type" in spec:
        return str(spec["type"]) + (" (imatrix)" if spec.get("imatrix") else "")
    if "bpw" in spec:
        return f"{spec['bpw']} bpw" + (f", head {spec['head_bits']}" if "head_bits" in spec else "")
    if "bits" in spec:
        group = f" g{spec['group_size']}" if "group_size" in spec else ""
        sym = "" if "symmetric" not in spec else (" sym" if spec["symmetric"] else " asym")
        return f"W{spec['bits']}{group}{sym}"
    return fmt


def _failure(results: Sequence[ResultView], kind: str) -> tuple[str, str | None]:
    failed = [r for r in results if r.kind == kind and r.status != "ok"]
    if not failed:
        return NOT_EVALUATED, None
    last = failed[-1]
    err = last.error or ""
    if last.status in UNAVAILABLE_STATUSES or err.startswith(UNAVAILABLE_ERRORS):
        return ENGINE_UNAVAILABLE, err or last.status
    return EVAL_FAILED, err or None


def metric_fields(fmt: str, results: Sequence[ResultView]) -> dict[str, Any]:
    """The metric columns of a row of format ``fmt`` from a version's results (oldest first), with reasons
    for gaps, the second figures of other engines and the marks the row needs."""
    out: dict[str, Any] = {}
    picked = pick(fmt, results)
    quality, speed = picked.quality, picked.speed
    if quality is None:
        out["quality_reason"], out["quality_error"] = _failure(results, "quality")
    else:
        m = quality.metrics
        out.update({k: v for k, v in quality_fields(m).items() if k in Row.model_fields})
        out.update(ppl_se=_se(m), engine=quality.engine, engine_version=quality.engine_version,
                   window_set_id=quality.window_set_id, quality_kernel=dense_kernel(m))
    if speed is None:
        out["speed_reason"], out["speed_error"] = _failure(results, "speed")
        if out["speed_reason"] == NOT_EVALUATED and quality is None:
            out["speed_reason"], out["speed_error"] = out["quality_reason"], out["quality_error"]
    else:
        out.update(pp_tok_s=median(speed.metrics.get("prompt_tok_per_s")),
                   tg_tok_s=median(speed.metrics.get("decode_tok_per_s")), speed_engine=speed.engine,
                   speed_kernel=dense_kernel(speed.metrics))
        if quality is None:
            out.update(engine=speed.engine, engine_version=speed.engine_version)
    out["engine_role"] = role_of(fmt, out.get("engine"))
    out["cross_checks"] = [SecondFigure(engine=r.engine, engine_version=r.engine_version, role=role,
                                        window_set_id=r.window_set_id, **_second_fields(r.metrics))
                           for role, r in picked.others]
    out["marks"] = row_marks(fmt, {**out, "cross_checks": [c.model_dump() for c in out["cross_checks"]]})
    return out


def serving_fields(s: ServingSummary | None) -> dict[str, Any]:
    """The ``memory_*`` columns of a row from its first serving summary (none: empty), with the marks they need."""
    if s is None:
        return {}
    m = s.memory
    return {"memory_peak_bytes": m.peak_bytes, "memory_source": m.source, "memory_context": m.context,
            "memory_users": m.users, "memory_engine": s.engine, "memory_profile": s.profile,
            "memory_kernel": s.kernel}


def _with_serving(fields: dict[str, Any], summaries: Sequence[ServingSummary]) -> dict[str, Any]:
    first = summaries[0] if summaries else None
    marks = [*fields.get("marks", []), *(k for k in (first.marks if first else []) if k not in fields.get("marks", []))]
    return {**fields, **serving_fields(first), "marks": marks}


def _second_fields(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in quality_fields(metrics).items() if k in SecondFigure.model_fields}


def _se(m: dict[str, Any]) -> float | None:
    """Standard error of PPL from the NLL's (delta method: se(PPL) = PPL * se(NLL))."""
    ppl, se = m.get("ppl"), m.get("nll_se")
    return float(ppl) * float(se) if isinstance(ppl, int | float) and isinstance(se, int | float) else None


def row_from_summary(s: VariantSummary, served: Sequence[ServingSummary] | None = None) -> Row:
    """A variant's row; ``served``: its serving summaries when the caller has them already."""
    served = serving_summaries(s.variant, s.ref, s.format, s.results) if served is None else served
    return Row(ref=s.ref, model=s.model, variant=s.variant, version=s.version, format=s.format,
               quant=quant_label(s.format, s.spec), state=s.state, aliases=s.aliases, size=s.size or None,
               bpw=s.bpw if s.bpw is not None else _spec_bpw(s.spec),
               **_with_serving(metric_fields(s.format, s.results), served))


def row_from_version(v: VersionView, aliases: dict[str, int] | None = None) -> Row:
    bpw = (v.lineage.get("info") or {}).get("bpw")
    return Row(ref=v.ref, model=v.model, variant=v.variant, version=v.number, format=v.format,
               quant=quant_label(v.format, v.spec), state=v.state,
               aliases=aliases if aliases is not None else dict.fromkeys(v.aliases, v.number), size=v.size or None,
               bpw=bpw if isinstance(bpw, int | float) else _spec_bpw(v.spec),
               **_with_serving(metric_fields(v.format, v.results),
                               serving_summaries(v.variant, v.ref, v.format, v.results)))


def _spec_bpw(spec: dict[str, Any]) -> float | None:
    bpw = spec.get("bpw")
    return float(bpw) if isinstance(bpw, int | float) else None


def sort_rows(rows: Iterable[Row], key: str | None, descending: bool = False) -> list[Row]:
    """Rows sorted by a column; rows without a value always go last, whatever the direction."""
    rows = list(rows)
    if key is None or (key not in METRICS and key not in ("variant", "format", "state", "engine", "memory")):
        return rows
    have = [r for r in rows if r.value(key) is not None]
    missing = [r for r in rows if r.value(key) is None]
    return sorted(have, key=lambda r: r.value(key), reverse=descending) + missing


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower x and lower y are better),
    ordered by x. Ties in x keep only the lowest y."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front: list[int] = []
    best_y = float("inf")
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def with_floors(rows: Sequence[Row], floors: Mapping[str, Mapping[str, Any]]) -> list[Row]:
    """``rows`` with ``within_noise_floor`` (and its mark) set against the floor of each row's own reference."""
    out = []
    for r in rows:
        inside = within_floor(r.model_dump(), floors.get(r.reference_key or ""))
        out.append(r.model_copy(update={"within_noise_floor": True, "marks": [*r.marks, WITHIN_FLOOR.key]})
                   if inside else r)
    return out


def chart_floor(rows: Sequence[Row], floors: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The noise floor a model page's chart draws: that of the reference most rows with an exact KLD were scored
    against (None when it has none), with ``rows``: how many of them share it, ``of``: how many there are."""
    keys = [r.reference_key for r in rows if r.kld is not None and r.reference_key]
    if not keys:
        return None
    key = max(set(keys), key=lambda k: (keys.count(k), k))
    floor = floors.get(key)
    return None if floor is None else {**floor, "rows": keys.count(key), "of": len(keys)}
