"""What a shown number is, said the same way wherever it is shown: the CLI results table (``convert``,
``demo``, ``compare``), ``quantyard show``, the registry's pages and chart, and the model card.

- :func:`pick` chooses the results a version's row shows: the format's own engine (:data:`FORMATS`) first,
  then its fallback (a stand-in), then any other engine, the newest within a rank. The other engines'
  quality results are second figures beside it (a cross-check), never a replacement of the engine's.
- :class:`Mark` is a footnote marker with its legend line, for a number that is not what its column's
  header alone says: a KLD that is a top-K lower bound (``≥…†``) or an estimate (``≈…‡``), a stand-in
  engine's row (``*``), a vLLM speed measured with Quantyard's dense-matmul replacement of vLLM's 4-bit
  kernel (``§``), a cross-check (``×``), a serving result under a CPU-scaled load shape (``¶``). Exact values
  carry no marker. Serving results (``kind`` serving, :mod:`pipeline.serving_summary`) are never a row's quality
  or speed: :func:`pick` reads only ``quality`` and ``speed`` results.
- :func:`quality_fields` gives a quality result's figures at full precision, each key meaning one thing:
  ``kld`` is only ever the exact full-vocabulary KLD; a bound is ``kld_lower_bound``, an estimate
  ``kld_estimate`` (:func:`pipeline.results.kld_of`). Human tables round when they print; ``--json`` never.
- :func:`eval_sets_note`: quality numbers on different window sets or against different references are
  not comparable; a table that holds both says which rows are on which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from pipeline.formats import FORMATS
from pipeline.results import KLDValue, VariantOutcome, kld_of

Role = Literal["engine", "stand-in", "cross-check", "other"]
ROLES: tuple[Role, ...] = ("engine", "stand-in", "cross-check", "other")
#: ``wna16_kernel_id`` of a vLLM result whose 4-bit linears ran Quantyard's dequantizing replacement
#: (evaluators.vllm.runner.DEQUANTIZED; a string here: the pipeline core never imports an engine).
WNA16_DEQUANTIZED = "dequantized"
#: Metric keys a row carries as they are (full precision).
COPIED = ("ppl", "ppl_ci95_low", "ppl_ci95_high", "ref_ppl", "delta_ppl_pct", "delta_ppl_pct_ci95_low",
          "delta_ppl_pct_ci95_high", "ci_method", "n_windows", "reference_key")


class ResultLike(Protocol):
    """A stored result as :func:`pick` reads it (``EvalResult``, the registry's ``ResultView``)."""

    @property
    def kind(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def metrics(self) -> dict[str, Any]: ...
    @property
    def window_set_id(self) -> str | None: ...


R = TypeVar("R", bound=ResultLike)


def role_of(fmt: str, engine: str | None) -> Role:
    """What ``engine`` is to format ``fmt`` when its result is the one a row shows: the format's ``engine``,
    its ``fallback_engine`` (a stand-in), its ``cross_check_engine``, or another. A format this
    installation does not know has nothing to say: ``engine``."""
    info = FORMATS.get(fmt)  # type: ignore[call-overload]  # a QuantFormat is its str value
    if info is None or engine is None or engine == info.engine:
        return "engine"
    if engine == info.fallback_engine:
        return "stand-in"
    return "cross-check" if engine == info.cross_check_engine else "other"


def second_role(fmt: str, engine: str) -> Role:
    """What ``engine`` is to ``fmt`` when its result is a second figure beside the shown one."""
    info = FORMATS.get(fmt)  # type: ignore[call-overload]
    return "cross-check" if info is not None and engine == info.cross_check_engine else role_of(fmt, engine)


@dataclass(frozen=True)
class Picked(Generic[R]):
    quality: R | None
    speed: R | None
    others: tuple[tuple[Role, R], ...] = ()  # other engines' newest quality results, with their role


def pick(fmt: str, results: Sequence[R]) -> Picked[R]:
    """The results a row of format ``fmt`` shows, from a version's ``results`` (oldest first): the quality
    and speed of the best-ranked engine (see :func:`role_of`; the newest within a rank), and the newest
    quality result of every other engine as a second figure."""
    ok = [r for r in results if r.status == "ok"]
    quality = _first(fmt, [r for r in ok if r.kind == "quality"])
    speed = _first(fmt, [r for r in ok if r.kind == "speed"])
    newest: dict[str, R] = {}
    for r in ok:
        if r.kind == "quality" and (quality is None or r.engine != quality.engine):
            newest[r.engine] = r
    return Picked(quality, speed, tuple((second_role(fmt, e), r) for e, r in newest.items()))


def _first(fmt: str, results: Sequence[R]) -> R | None:
    best: R | None = None
    for r in results:  # oldest first: a newer result of the same rank replaces an older one
        if best is None or ROLES.index(role_of(fmt, r.engine)) <= ROLES.index(role_of(fmt, best.engine)):
            best = r
    return best


# -- marks -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mark:
    """A footnote marker: ``symbol`` next to the number, ``text`` in the legend of the table."""

    key: str
    symbol: str
    text: str

    @property
    def line(self) -> str:
        return f"{self.symbol} {self.text}"


KLD_LOWER_BOUND = Mark("kld-lower-bound", "†", "≥ KLD is a top-K lower bound, not the full-vocabulary KLD (which is "
                       "at least this): a result in the cheaper top-K mode, or one stored before exact KLD")
KLD_ESTIMATE = Mark("kld-estimate", "‡", "≈ KLD is an estimate from vLLM's top-256 log-probs (stored before exact "
                    "KLD), not the full-vocabulary KLD")
DENSE_KERNEL = Mark("dense-kernel", "§", "computed with a dense-matmul stand-in for vLLM's 4-bit kernel: Quantyard "
                    "dequantized the 4-bit weights on this CPU, so a quality figure is that of the dequantized weights "
                    "in the recorded dtype, and a speed or serving latency is not that of vLLM's own 4-bit kernel")
CROSS_CHECK = Mark("cross-check", "×", "cross-check: the same files scored by a second engine, shown beside the "
                   "format engine's figures, never in their place")
OTHER_ENGINE = Mark("other-engine", "°", "measured on an engine that is not this format's own")
CPU_SCALED = Mark("cpu-scaled", "¶", "serving load with a CPU-scaled shape (shorter prompts and outputs than the seed "
                  "profile, as its load profile says): not the seed profile's latencies or throughput")
WITHIN_FLOOR = Mark("noise-floor", "≃", "within the noise floor: its exact KLD cannot be told from that of a second "
                    "unquantized run of the source differing only in arithmetic (their 95 % intervals overlap), so "
                    "the variant is indistinguishable from the reference on these windows")
FIXED_MARKS = {m.key: m for m in (KLD_LOWER_BOUND, KLD_ESTIMATE, DENSE_KERNEL, CROSS_CHECK, OTHER_ENGINE, CPU_SCALED,
                                  WITHIN_FLOOR)}


#: The registry kind of a source's noise-floor artifact (flows/steps.py ``ensure_noise_floor``).
NOISE_FLOOR_KIND = "noise_floor"


def within_floor(fields: Mapping[str, Any], floor: Mapping[str, Any] | None) -> bool:
    """Whether a row's exact KLD is within the noise floor (``floor``: the run's noise-floor summary): its 95 %
    interval reaches the floor's (the means where intervals are missing). False without an exact KLD or a floor."""
    if not floor or floor.get("kld_mean") is None or fields.get("kld") is None:
        return False
    low: Any = fields.get("kld_ci95_low")
    high: Any = floor.get("kld_ci95_high")
    low = fields["kld"] if low is None else low
    high = floor["kld_mean"] if high is None else high
    return float(low) <= float(high)


def stand_in_mark(fmt: str, engine: str) -> Mark:
    """The marker of a stand-in engine's row, with what the format's table line says the stand-in is."""
    info = FORMATS.get(fmt)  # type: ignore[call-overload]
    note = info.fallback_note if info is not None and info.fallback_note else "not the format's own engine"
    return Mark(f"stand-in:{fmt}:{engine}", "*", f"stand-in ({engine}): {note}")


def mark_of(key: str) -> Mark:
    """The :class:`Mark` of a key in a row's ``marks``.

    Raises:
        KeyError: no such mark.
    """
    if key.startswith("stand-in:"):
        _, fmt, engine = key.split(":", 2)
        return stand_in_mark(fmt, engine)
    return FIXED_MARKS[key]


def engine_mark(fmt: str, engine: str | None, role: str) -> Mark | None:
    """The marker of a result of ``engine`` in ``role`` (see :func:`role_of`): None for the format's own engine."""
    if engine is None or role == "engine":
        return None
    return stand_in_mark(fmt, engine) if role == "stand-in" else CROSS_CHECK if role == "cross-check" \
        else OTHER_ENGINE


def legend(keys: Iterable[str]) -> list[Mark]:
    """The marks of ``keys`` (repeats dropped), in a fixed order: KLD kinds, engines, speed."""
    order = list(FIXED_MARKS)
    unique = sorted(set(keys), key=lambda k: (order.index(k) if k in order else len(order), k))
    return [mark_of(k) for k in unique]


def kld_mark(k: KLDValue) -> Mark | None:
    return {"lower_bound": KLD_LOWER_BOUND, "estimate": KLD_ESTIMATE}.get(k.kind)


def kld_text(k: KLDValue, number: Callable[[float], str]) -> str:
    """A KLD as a table shows it: exact values plain, a bound ``≥…†``, an estimate ``≈…‡``; "" when missing."""
    if k.value is None:
        return ""
    mark = kld_mark(k)
    if mark is None:
        return number(k.value)
    return f"{'≥' if k.kind == 'lower_bound' else '≈'}{number(k.value)}{mark.symbol}"


def dense_kernel(speed_metrics: Mapping[str, Any]) -> str | None:
    """The kernel's name when a speed was measured with Quantyard's dense-matmul replacement of vLLM's
    4-bit kernel (``wna16_kernel_id`` = ``dequantized``), else None."""
    if speed_metrics.get("wna16_kernel_id") != WNA16_DEQUANTIZED:
        return None
    return str(speed_metrics.get("wna16_kernel") or WNA16_DEQUANTIZED)


# -- fields ------------------------------------------------------------------------------------------------


def quality_fields(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A quality result's figures for a table row or ``--json``, unrounded. ``kld`` is the exact KLD or None;
    ``kld_lower_bound`` / ``kld_estimate`` hold the other kinds; ``kld_kind`` says which one is set;
    ``kld_ci95_*`` is the exact KLD's interval. ``top1_pct`` is top-1 agreement in percent."""
    k = kld_of(dict(metrics))
    top1 = metrics.get("top1_agreement")
    ci = k.ci95 if k.exact else None
    return {**{key: metrics.get(key) for key in COPIED},
            "kld": k.value if k.exact else None,
            "kld_p99": metrics.get("kld_p99") if k.exact else None,  # the exact KLD's tail (llama-perplexity's 99 %)
            "kld_lower_bound": k.value if k.kind == "lower_bound" else None,
            "kld_estimate": k.value if k.kind == "estimate" else None,
            "kld_kind": None if k.kind == "missing" else k.kind, "kld_method": k.method,
            "kld_ci95_low": ci[0] if ci else None, "kld_ci95_high": ci[1] if ci else None,
            "top1_pct": 100.0 * top1 if isinstance(top1, int | float) and not isinstance(top1, bool) else None}


def shown_kld(fields: Any) -> KLDValue:
    """The one KLD of a row made by :func:`quality_fields` (a mapping, or an object with those attributes),
    with its kind."""
    get = fields.get if isinstance(fields, Mapping) else lambda key: getattr(fields, key, None)
    for key, kind in (("kld", "exact"), ("kld_lower_bound", "lower_bound"), ("kld_estimate", "estimate")):
        value = get(key)
        if value is not None:
            return KLDValue(value=float(value), kind=kind, method=get("kld_method"))  # type: ignore[arg-type]
    return KLDValue(value=None, kind="missing")


def median(x: Any) -> float | None:
    """A speed figure: a plain number, or the ``median`` of a repeated measurement."""
    if isinstance(x, dict):
        x = x.get("median")
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


# -- llama-perplexity's statistics ---------------------------------------------------------------------------

#: The lines of ``llama-perplexity --kl-divergence``'s summary, in its order: (label, key, the unit shown: "" as is,
#: "%" ×100). evaluators/metrics.py computes each with llama-perplexity's definitions.
LLAMA_LINES: tuple[tuple[str, str, str], ...] = (
    ("PPL(Q)", "ppl", ""), ("PPL(base)", "ref_ppl", ""), ("Cor(ln PPL(Q), ln PPL(base))", "ln_ppl_cor", "%"),
    ("ln(PPL(Q)/PPL(base))", "ln_ppl_ratio", ""), ("PPL(Q)/PPL(base)", "ppl_ratio", ""),
    ("PPL(Q)−PPL(base)", "ppl_diff", ""), ("mean KLD", "kld_mean", ""), ("maximum KLD", "kld_max", ""),
    ("99.9 % KLD", "kld_p999", ""), ("99 % KLD", "kld_p99", ""), ("95 % KLD", "kld_p95", ""),
    ("90 % KLD", "kld_p90", ""), ("median KLD", "kld_median", ""), ("10 % KLD", "kld_p10", ""),
    ("5 % KLD", "kld_p5", ""), ("1 % KLD", "kld_p1", ""), ("0.1 % KLD", "kld_p01", ""), ("minimum KLD", "kld_min", ""),
    ("mean Δp", "delta_p_mean", "%"), ("maximum Δp", "delta_p_max", "%"), ("99.9 % Δp", "delta_p_p999", "%"),
    ("99 % Δp", "delta_p_p99", "%"), ("95 % Δp", "delta_p_p95", "%"), ("90 % Δp", "delta_p_p90", "%"),
    ("75 % Δp", "delta_p_p75", "%"), ("median Δp", "delta_p_median", "%"), ("25 % Δp", "delta_p_p25", "%"),
    ("10 % Δp", "delta_p_p10", "%"), ("5 % Δp", "delta_p_p5", "%"), ("1 % Δp", "delta_p_p1", "%"),
    ("0.1 % Δp", "delta_p_p01", "%"), ("minimum Δp", "delta_p_min", "%"), ("RMS Δp", "delta_p_rms", "%"),
    ("same top p", "top1_agreement", "%"))


def llama_statistics(metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A quality result's statistics as ``llama-perplexity --kl-divergence`` prints them (label, value ± its
    uncertainty where llama-perplexity gives one), for the version page, ``show`` and the model card; [] for a
    result without them (a top-K bound, or one stored before they were computed)."""
    if metrics.get("kld_p95") is None or not kld_of(dict(metrics)).exact:
        return []
    out = []
    for label, key, unit in LLAMA_LINES:
        value = metrics.get(key)
        if not isinstance(value, int | float):
            continue
        scale, suffix = (100.0, " %") if unit == "%" else (1.0, "")
        unc = metrics.get(f"{key}_unc")
        text = f"{scale * value:.6g}" + (f" ± {scale * unc:.3g}" if isinstance(unc, int | float) else "") + suffix
        out.append((label, text))
    return out


def confidence_rows(metrics: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The KLD and same top p by the reference's confidence (evaluators/metrics.py ``by_confidence``)."""
    rows = metrics.get("kld_by_confidence")
    return list(rows) if isinstance(rows, list) else []


# -- window sets and references ----------------------------------------------------------------------------


def eval_set_label(window_set_id: str | None, reference_key: str | None) -> str:
    ref = f"reference {reference_key[:12]}" if reference_key else "reference not recorded"
    return f"window set {(window_set_id or 'not recorded')[:12]}, {ref}"


def eval_sets_note(figures: Iterable[tuple[str, str | None, str | None]]) -> str | None:
    """A note naming the sets when quality figures ``(name, window_set_id, reference_key)`` come from more
    than one window set or reference (a result stored without a ``reference_key`` counts as its own), else
    None. Names are listed under their set."""
    groups: dict[tuple[str | None, str | None], list[str]] = {}
    for name, ws, ref in figures:
        groups.setdefault((ws, ref), []).append(name)
    if len(groups) < 2:
        return None
    sets = "; ".join(f"{eval_set_label(ws, ref)}: {', '.join(names)}" for (ws, ref), names in groups.items())
    return (f"quality figures from {len(groups)} different window sets or references, comparable only "
            f"within one — {sets}")


def row_figures(rows: Iterable[Mapping[str, Any]]) -> list[tuple[str, str | None, str | None]]:
    """``(name, window_set_id, reference_key)`` of every quality figure of :func:`table_rows` rows."""
    out = []
    for r in rows:
        if r.get("ppl") is not None or shown_kld(r).value is not None:
            out.append((str(r["variant"]), r.get("window_set_id"), r.get("reference_key")))
        for c in r.get("cross_checks") or []:
            out.append((f"{r['variant']} ({c['engine']})", c.get("window_set_id"), c.get("reference_key")))
    return out


# -- the results table -------------------------------------------------------------------------------------


def table_rows(variants: Sequence[VariantOutcome], floor: Mapping[str, Any] | None = None,
               floors: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The results table (CLI, Prefect artifact, ``compare --json``): one row per variant, unrounded (the
    human table rounds when it prints). Quality keys are :func:`quality_fields`'; ``engine_role`` is
    :func:`role_of`; ``speed_kernel`` / ``quality_kernel`` name a dense-matmul stand-in kernel that measured the
    speed / computed the quality figures; ``cross_checks`` are other
    engines' figures; ``marks`` are the keys of the row's :class:`Mark` s (:func:`mark_of`); ``within_noise_floor``
    (:func:`within_floor`) against the run's noise ``floor``, or against the floor of each row's own reference in
    ``floors`` (by reference key: registry ``noise_floors``)."""
    by_ref = dict(floors or {})
    if floor and floor.get("reference_key"):
        by_ref[str(floor["reference_key"])] = floor
    rows = [_row(v) for v in variants]
    for row in rows:
        row["within_noise_floor"] = within_floor(row, by_ref.get(str(row.get("reference_key"))) or
                                                 (floor if not by_ref else None))
        if row["within_noise_floor"]:
            row["marks"].append(WITHIN_FLOOR.key)
    return rows


def _row(v: VariantOutcome) -> dict[str, Any]:
    s = v.speed or {}
    role = role_of(v.format, v.engine)
    row: dict[str, Any] = {
        "variant": v.variant, "ref": v.ref or "", "format": v.format,
        "size_mb": v.size / 1e6 if v.size else None, "bpw": v.bpw, **quality_fields(v.quality or {}),
        "pp_tok_s": median(s.get("prompt_tok_per_s")), "tg_tok_s": median(s.get("decode_tok_per_s")),
        "speed_kernel": dense_kernel(s), "quality_kernel": dense_kernel(v.quality or {}),
        "engine": v.engine or "", "engine_version": v.engine_version,
        "engine_role": role, "speed_engine": v.speed_engine, "window_set_id": v.window_set_id,
        "status": v.status if v.eval_status in (None, "ok", "reused") else f"{v.status}, eval {v.eval_status}",
        "cross_checks": [{"engine": c.engine, "engine_version": c.engine_version,
                          "role": second_role(v.format, c.engine), "window_set_id": c.window_set_id,
                          **quality_fields(c.quality)} for c in v.cross_checks]}
    row["marks"] = row_marks(v.format, row)
    return row


def row_marks(fmt: str, row: Mapping[str, Any]) -> list[str]:
    """The mark keys a row (and its cross-checks) needs."""
    marks = []
    mark = engine_mark(fmt, row.get("engine") or None, row.get("engine_role") or "engine")
    dense = row.get("speed_kernel") or row.get("quality_kernel")
    for m in (mark, kld_mark(shown_kld(row)), DENSE_KERNEL if dense else None):
        if m is not None:
            marks.append(m.key)
    for c in row.get("cross_checks") or []:
        for m in (engine_mark(fmt, c["engine"], c["role"]), kld_mark(shown_kld(c))):
            if m is not None and m.key not in marks:
                marks.append(m.key)
    return marks


__all__ = ["CPU_SCALED", "CROSS_CHECK", "DENSE_KERNEL", "KLD_ESTIMATE", "KLD_LOWER_BOUND", "Mark", "Picked",
           "ResultLike", "Role", "dense_kernel", "engine_mark", "eval_sets_note", "kld_mark", "kld_text", "legend",
           "mark_of", "median", "pick", "quality_fields", "role_of", "row_figures", "row_marks", "second_role",
           "shown_kld", "table_rows"]
