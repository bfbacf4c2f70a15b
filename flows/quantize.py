"""The conversion flow: resolve → (shared base once) → build each variant → register → evaluate.

Re-running is cheap by construction: a variant whose build key is already registered is
reused without any conversion, the GGUF base is cached per source, and window sets and
reference log-probs are registry artifacts of the source. One variant failing (conversion or
engine) is recorded and the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow

from flows import steps
from flows.tasks import (
    build_task,
    evaluate_task,
    prepare_task,
    reference_task,
    register_task,
    resolve_task,
    window_set_task,
)
from pipeline.config import Settings
from pipeline.errors import DiskFullError, QuantyardError
from pipeline.plan import Plan
from pipeline.progress import stage
from pipeline.results import ConvertReport, VariantOutcome, table_rows


@contextmanager
def _timed(report: ConvertReport, name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        report.stage_s[name] = report.stage_s.get(name, 0.0) + time.perf_counter() - t0


def _plan_builds(plan: Plan, settings: Settings, resolved: steps.Resolved, report: ConvertReport,
                 outcomes: dict[str, VariantOutcome]) -> dict[str, list[tuple[Any, str]]]:
    """Compute build keys; keep only variants not already registered with the same key."""
    todo: dict[str, list[tuple[Any, str]]] = {}
    for fmt, specs in plan.by_format().items():
        for spec in specs:
            key = steps.build_key(resolved.source, spec, steps.tool_identity(fmt, plan, settings, spec),
                                  steps.build_inputs(plan, resolved, spec, settings))
            existing = None if plan.force else steps.find_existing(settings, resolved, spec, key)
            if existing is not None:
                out = outcomes[spec.name]
                out.ref, out.status, out.size = existing.ref, "reused", existing.size
                out.bpw = (existing.lineage.get("info") or {}).get("bpw")
                report.events.append(f"reuse:{spec.name}")
            else:
                todo.setdefault(fmt, []).append((spec, key))
    return todo


def _build_all(plan: Plan, settings: Settings, resolved: steps.Resolved, report: ConvertReport,
               outcomes: dict[str, VariantOutcome], todo: dict[str, list[tuple[Any, str]]]) -> None:
    staging_tmp = steps.scratch_dir(settings, "staging")
    staging = Path(staging_tmp.name)
    try:
        for fmt, items in todo.items():
            with _timed(report, f"prepare:{fmt}"), stage("prepare", fmt):
                prepared = prepare_task(fmt, plan, resolved, [s for s, _ in items], settings)
            report.events.extend(prepared.events)
            for spec, key in items:
                out = outcomes[spec.name]
                try:
                    with _timed(report, "build"), stage("build", spec.name):
                        built = build_task(fmt, plan, resolved, prepared, spec, settings, staging)
                    with _timed(report, "register"), stage("register", spec.name):
                        view = register_task(settings, plan, resolved, spec, built, key)
                except DiskFullError:
                    raise  # no later variant can succeed either: stop with the clear error
                except QuantyardError as exc:
                    out.status, out.error, out.error_type = "failed", exc.summary(), type(exc).__name__
                    report.events.append(f"failed:{spec.name}")
                    continue
                report.events.extend(f"{e}:{spec.name}" for e in built.events)
                out.ref, out.created, out.size = view.ref, view.created, view.size
                out.status = "registered" if view.created else "reused"
                out.events, out.bpw = list(built.events), built.info.get("bpw")
    finally:
        staging_tmp.cleanup()


def _evaluate_all(plan: Plan, settings: Settings, resolved: steps.Resolved, report: ConvertReport,
                  outcomes: dict[str, VariantOutcome]) -> None:
    ready = [o for o in outcomes.values() if o.ref is not None]
    if not plan.eval.enabled or not ready:
        return
    with _timed(report, "window_set"), stage("window-set"):
        windows, ws_meta, built = window_set_task(settings, resolved, plan.eval)
    report.window_set = ws_meta
    if built:
        report.events.append("window_set")
    with _timed(report, "reference"), stage("reference"):
        reference, ref_meta, computed = reference_task(settings, resolved, windows, ws_meta, plan.eval)
    report.reference = ref_meta
    if computed:
        report.events.append("reference")
    for out in ready:
        _evaluate_one(plan, settings, report, out, windows, ws_meta, reference)


def _evaluate_one(plan: Plan, settings: Settings, report: ConvertReport, out: VariantOutcome,
                  windows: Any, ws_meta: dict[str, Any], reference: Any) -> None:
    from evaluators.engines import engine_for
    from registry import open_registry

    assert out.ref is not None
    engine, _ = engine_for(out.format, settings)
    version = open_registry(settings).get_version(out.ref)
    out.engine = engine
    if steps.has_quality_result(version, engine, str(ws_meta["id"])):
        _fill_from_results(out, version, engine, str(ws_meta["id"]))
        out.eval_status = "reused"
        return
    try:
        with _timed(report, "evaluate"), stage("evaluate", out.variant):
            outcome = evaluate_task(settings, out.ref, out.format, windows, ws_meta, reference, plan.eval)
    except QuantyardError as exc:
        out.eval_status, out.eval_error = "failed", exc.summary()
        report.events.append(f"eval_failed:{out.variant}")
        return
    report.events.append(f"evaluate:{out.variant}")
    out.eval_status, out.quality, out.speed = "ok", outcome.quality, outcome.speed
    out.engine_version = outcome.engine_version
    _cross_check(plan, settings, report, out, windows, ws_meta, reference)


def _cross_check(plan: Plan, settings: Settings, report: ConvertReport, out: VariantOutcome, windows: Any,
                 ws_meta: dict[str, Any], reference: Any) -> None:
    """A second engine on the same file (AWQ: transformers), recorded as its own result."""
    from evaluators.engines import engines_of, get_evaluator
    from registry import open_registry

    assert out.ref is not None
    engines = engines_of(out.format, plan.eval.cross_check)[1:]
    if not engines:
        return
    (engine,) = engines
    spec = open_registry(settings).get_version(out.ref).spec
    if get_evaluator(engine).skip_reason(spec):
        report.events.append(f"cross_check_skipped:{out.variant}")
        return
    try:
        with _timed(report, "cross_check"), stage("cross-check", out.variant):
            evaluate_task(settings, out.ref, out.format, windows, ws_meta, reference, plan.eval, engine)
    except QuantyardError as exc:
        report.events.append(f"cross_check_failed:{out.variant}")
        out.eval_error = f"cross-check on {engine}: {exc.summary()}"
        return
    report.events.append(f"cross_check:{out.variant}")


def _fill_from_results(out: VariantOutcome, version: Any, engine: str, ws_id: str) -> None:
    for r in version.results:
        if r.status != "ok" or r.engine != engine:
            continue
        if r.kind == "quality" and r.window_set_id == ws_id:
            out.quality, out.engine_version = r.metrics, r.engine_version
        elif r.kind == "speed":
            out.speed = r.metrics


def _publish_artifact(report: ConvertReport) -> None:
    from prefect.artifacts import create_table_artifact

    slug = "".join(c if c.isalnum() else "-" for c in report.model.lower()).strip("-")
    create_table_artifact(table_rows(report.variants), key=f"quantyard-results-{slug}"[:100],
                          description=f"Quantyard results for {report.model} ({report.source['identity']})")


@flow(name="quantyard-convert", log_prints=True)
def convert_flow(plan: Plan, settings: Settings) -> ConvertReport:
    """Convert one source into every variant of ``plan``, evaluate and register them."""
    from registry import open_registry

    t0 = time.perf_counter()
    open_registry(settings)  # a bad registry location fails before any work is done
    steps.sweep_stale(settings)
    plan = steps.resolve_backends(plan, settings)
    with stage("resolve", plan.source.source):
        resolved = resolve_task(plan, settings)
    src = resolved.source
    report = ConvertReport(model=resolved.model_name, source={"identity": src.identity, "path": src.path,
                                                             "repo_id": src.repo_id, "commit": src.commit})
    report.stage_s["resolve"] = time.perf_counter() - t0
    outcomes = {s.name: VariantOutcome(variant=s.name, format=str(s.format)) for s in plan.variants}
    todo = _plan_builds(plan, settings, resolved, report, outcomes)
    _build_all(plan, settings, resolved, report, outcomes, todo)
    _evaluate_all(plan, settings, resolved, report, outcomes)
    report.variants = list(outcomes.values())
    report.wall_s = time.perf_counter() - t0
    _publish_artifact(report)
    return report
