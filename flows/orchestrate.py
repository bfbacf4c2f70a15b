"""The orchestrating flow of a distributed run: the stages of flows/stages.py, each run as a Prefect
deployment on the work pool its placement names, in parallel where they are independent::

    resolve ─┬─ prepare:FMT ── build:VARIANT ── register:VARIANT ─┬─ evaluate:VARIANT:ENGINE
             └─ reference ─────────────────────────────────────────┘

Before dispatching a stage the orchestrator looks its key up in the stage ledger (flows/ledger.py): a
stage already recorded, whose outputs are still in the registry, is reused without a flow run. A rerun of
a finished run therefore dispatches nothing, and a rerun after a crash starts at the first stage that
did not finish. ``dispatch="local"`` runs the same stage flows in this process (tests, one machine).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from converters.lookup import converter_class
from evaluators.engines import engine_info, engines_of
from flows.ledger import StageRecord, find_stage, pin_source, stage_key
from flows.stages import STAGE_FLOWS, StageName, StageRequest, deployment_name
from pipeline.config import Settings
from pipeline.errors import ConfigError, NotFoundError, QuantyardError, StageError
from pipeline.formats import format_info
from pipeline.plan import Plan
from pipeline.recipe import Placement
from pipeline.results import ConvertReport, VariantOutcome, table_rows
from registry import open_registry
from registry.store import Registry

Dispatch = Literal["deployments", "local"]
#: Keys tried for one stage: the key itself, then retries when a recorded output vanished from the registry.
KEY_RETRIES = 4


@dataclass
class Node:
    request: StageRequest
    deps: tuple[str, ...] = ()


@dataclass
class Graph:
    identity: str
    nodes: dict[str, Node] = field(default_factory=dict)

    def add(self, request: StageRequest, deps: tuple[str, ...] = ()) -> str:
        self.nodes[request.name] = Node(request, deps)
        return request.name


def _prepare_spec(fmt: str, plan: Plan, specs: list[Any]) -> dict[str, Any]:
    """What a format's shared preparation depends on: the converter says (``prepare_inputs``; GGUF: the base
    type, and the imatrix calibration when a variant needs one, so adding a type reuses the base), else every
    variant of the format."""
    cls = converter_class(fmt)
    if hasattr(cls, "prepare_inputs"):
        return dict(cls.prepare_inputs(plan.build_options(fmt), specs))
    return {"specs": [s.model_dump(mode="json") for s in specs]}


def _build_spec(fmt: str, plan: Plan, spec: Any) -> dict[str, Any]:
    return {"spec": spec.model_dump(mode="json"), "options": plan.build_options(fmt)}


def _eval_spec(plan: Plan) -> dict[str, Any]:
    spec = plan.eval.model_dump(mode="json", exclude={"speed", "cross_check", "enabled"})
    return {"eval": spec, "text_sha256": _text_digest(plan.eval.text_file)}


def _text_digest(path: str | None) -> str | None:
    import hashlib
    from pathlib import Path

    if not path or not Path(path).is_file():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_graph(plan: Plan, identity: str, placement: Placement, target: dict[str, str | None],
                nonce: str | None = None) -> Graph:
    """Every stage of ``plan`` with its key, pool, request and dependencies (in a topological order).
    ``nonce`` (``--force``) makes build, register and evaluation keys unique to this run."""
    graph = Graph(identity)

    def request(stage: StageName, name: str, spec: dict[str, Any], tools: list[str], pool: str, sub: Plan,
                upstream: dict[str, str], **kw: Any) -> StageRequest:
        key = stage_key(identity, stage, {**spec, "nonce": nonce} if nonce and stage in
                        ("build", "register", "evaluate") else spec, tools)
        return StageRequest(stage=stage, name=name, key=key, source_identity=identity, plan=sub, upstream=upstream,
                            pool=pool, registry=target.get("registry"), blobs=target.get("blobs"), **kw)

    bare = plan.model_copy(update={"variants": ()})
    res = request("resolve", "resolve", {"source": plan.source.model_dump(mode="json"), "name": plan.model_name},
                  [], placement.resolve, bare, {})
    graph.add(res)
    up = {"resolve": res.key}
    ref = None
    if plan.eval.enabled:
        ref = request("reference", "reference", _eval_spec(plan), [], placement.for_reference(plan.eval), bare, up)
        graph.add(ref, ("resolve",))
    for fmt, specs in plan.by_format().items():
        pool = placement.for_format(fmt)
        fmt_plan = plan.model_copy(update={"variants": tuple(specs)})
        prep = request("prepare", f"prepare:{fmt}", {"format": fmt, **_prepare_spec(fmt, plan, specs)}, [fmt],
                       pool, fmt_plan, up, fmt=fmt)
        graph.add(prep, ("resolve",))
        for spec in specs:
            one = plan.model_copy(update={"variants": (spec,)})
            build = request("build", f"build:{spec.name}", {**_build_spec(fmt, plan, spec), "prepare": prep.key},
                            [fmt], pool, one, {**up, "prepare": prep.key}, fmt=fmt, variant=spec.name)
            graph.add(build, (prep.name,))
            reg = request("register", f"register:{spec.name}", {"build": build.key, "force": plan.force}, [],
                          placement.registration, one, {**up, "build": build.key}, fmt=fmt, variant=spec.name)
            graph.add(reg, (build.name,))
            if ref is None:
                continue
            for engine in engines_of(fmt, plan.eval.cross_check):
                ev = request("evaluate", f"evaluate:{spec.name}:{engine}",
                             {"register": reg.key, "engine": engine, **_eval_spec(plan),
                              "eval_all": plan.eval.model_dump(mode="json")}, [engine],
                             placement.for_engine(engine, engine_info(engine).pool), one,
                             {**up, "register": reg.key, "reference": ref.key}, fmt=fmt, variant=spec.name,
                             engine=engine)
                graph.add(ev, (reg.name, ref.name))
    return graph


# --- running one stage ---------------------------------------------------------------------------


def _still_there(reg: Registry, record: StageRecord) -> bool:
    """Whether a recorded stage's outputs are still in the registry (a version, blobs, artifacts)."""
    out = record.outputs
    try:
        if "ref" in out:
            reg.get_version(out["ref"])
    except NotFoundError:
        return False
    blobs = [*(out.get("files") or {}).values(), *(out.get("shared") or {}).values()]
    blobs += [out[k] for k in ("window_set", "reference") if k in out]
    return all(reg.blobs.exists(b["sha256"]) for b in blobs)


def reusable(reg: Registry, request: StageRequest) -> tuple[StageRecord | None, StageRequest]:
    """The stage's valid ledger record, if any, and the request to run otherwise (its key moves on when a
    recorded output vanished, e.g. blobs of a build that was never registered, removed by gc)."""
    key = request.key
    for attempt in range(KEY_RETRIES):
        candidate = key if attempt == 0 else f"{key}:{attempt}"
        record = find_stage(reg, request.source_identity, candidate)
        if record is None:
            return None, request.model_copy(update={"key": candidate})
        if _still_there(reg, record):
            return record, request.model_copy(update={"key": candidate})
    raise StageError(f"stage {request.name}: {KEY_RETRIES} recorded outputs have vanished from the registry",
                     hint="run `quantyard registry verify`; is gc running with a short grace period?")


def _dispatch(request: StageRequest, dispatch: Dispatch, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    """Run one stage; returns (finished, facts about the run: flow run id, work pool, state message)."""
    if dispatch == "local":
        try:
            STAGE_FLOWS[request.stage](request=request)
        except QuantyardError as exc:
            return False, {"error": exc.summary()}
        return True, {"work_pool": None}
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    name = deployment_name(request.stage, request.pool)
    try:
        run = run_deployment(name, parameters={"request": request.model_dump(mode="json")}, timeout=timeout_s,
                             poll_interval=1, tags=["quantyard", f"stage:{request.stage}"])
    except ObjectNotFound:
        raise ConfigError(f"the Prefect server has no deployment {name}",
                          hint="run `quantyard deploy` against this server (PREFECT_API_URL) first") from None
    # run_deployment is typed FlowRun | Coroutine (it dispatches on the caller's context); in this sync task
    # it runs synchronously and returns the FlowRun.
    assert isinstance(run, FlowRun), f"run_deployment returned {type(run).__name__} in a sync task"
    facts = {"flow_run_id": str(run.id), "work_pool": run.work_pool_name, "state": run.state_name}
    if run.state is None or not run.state.is_completed():
        facts["error"] = f"flow run {run.name} ended {run.state_name}: {run.state.message if run.state else ''}"
        return False, facts
    return True, facts


@task(name="stage", task_run_name="{request.name}", cache_policy=NONE)
def stage_task(request: StageRequest, upstream: list[dict[str, Any]], dispatch: Dispatch,
               timeout_s: float) -> dict[str, Any]:
    """Reuse the stage's ledger record, or dispatch it once every upstream stage finished."""
    logger = get_run_logger()
    base = {"stage": request.name, "pool": request.pool, "key": request.key, "record": None}
    blocked = [u["stage"] for u in upstream if u["status"] not in ("ran", "reused")]
    if blocked:
        logger.info("stage %-34s %-4s skipped: %s did not finish", request.name, request.pool, ", ".join(blocked))
        return {**base, "status": "skipped", "error": f"upstream {', '.join(blocked)} did not finish"}
    reg = open_registry(_settings(request))
    record, request = reusable(reg, request)
    base["key"] = request.key
    if record is not None:
        logger.info("stage %-34s %-4s reused  key %s (recorded by flow run %s)", request.name, request.pool,
                    request.key[:16], record.flow_run_id)
        return {**base, "status": "reused", "record": record.model_dump(mode="json")}
    t0 = time.perf_counter()
    ok, facts = _dispatch(request, dispatch, timeout_s)
    record = find_stage(reg, request.source_identity, request.key) if ok else None
    if ok and record is None:
        ok, facts["error"] = False, "the stage finished without recording its output in the ledger"
    status = "ran" if ok else "failed"
    logger.info("stage %-34s %-4s %-7s key %s in %.1f s%s", request.name, request.pool, status, request.key[:16],
                time.perf_counter() - t0, f": {facts.get('error')}" if not ok else "")
    return {**base, **facts, "status": status, "dispatch_s": time.perf_counter() - t0,
            "record": record.model_dump(mode="json") if record else None}


def _settings(request: StageRequest) -> Settings:
    from flows.stages import stage_settings

    return stage_settings(request)


# --- the flow ------------------------------------------------------------------------------------


@flow(name="quantyard-orchestrate", log_prints=True)
def orchestrate_flow(plan: Plan, registry: str | None = None, blobs: str | None = None,
                     placement: Placement | None = None, dispatch: Dispatch = "deployments",
                     timeout_s: float | None = None) -> ConvertReport:
    """Run ``plan`` as stages on the work pools (see the module docstring); returns the same report as the
    embedded flow, with one entry per stage in ``report.stages``."""
    t0 = time.perf_counter()
    settings = Settings(**{k: v for k, v in (("registry", registry), ("blobs", blobs)) if v})  # type: ignore[arg-type]
    reg = open_registry(settings)  # a bad registry location fails before any work is dispatched
    identity, pinned, source = pin_source(plan.source, settings)
    pinned_plan = plan.model_copy(update={"source": pinned})
    graph = build_graph(pinned_plan, identity, placement or Placement(),
                        {"registry": settings.registry, "blobs": settings.blobs},
                        nonce=uuid.uuid4().hex if plan.force else None)
    futures: dict[str, Any] = {}
    for name, node in graph.nodes.items():
        futures[name] = stage_task.submit(node.request, [futures[d] for d in node.deps], dispatch,
                                          timeout_s or settings.convert_timeout_s)
    outcomes = {name: f.result() for name, f in futures.items()}
    report = _report(plan, identity, source, graph, outcomes, reg)
    report.wall_s = time.perf_counter() - t0
    _publish(report)
    return report


def _report(plan: Plan, identity: str, source: Any, graph: Graph, outcomes: dict[str, dict[str, Any]],
            reg: Registry) -> ConvertReport:
    resolved = (outcomes["resolve"].get("record") or {}).get("outputs") or {}
    report = ConvertReport(model=resolved.get("model") or plan.model_name or "?",
                           source={"identity": identity, "path": source.path or None, "repo_id": source.repo_id,
                                   "commit": source.commit})
    for name, out in outcomes.items():
        record = out.get("record") or {}
        entry = {k: out.get(k) for k in ("stage", "pool", "key", "status", "flow_run_id", "work_pool", "error",
                                         "dispatch_s")}
        entry.update(work_s=record.get("work_s"), wall_s=record.get("wall_s"), deps=list(graph.nodes[name].deps))
        report.stages.append(entry)
        if out["status"] == "ran":
            report.events.extend(f"{e}:{name}" for e in (record.get("outputs") or {}).get("events") or [])
            report.stage_s[name] = float(out.get("dispatch_s") or 0.0)
        report.events.append(f"stage_{out['status']}:{name}")
    reference = (outcomes.get("reference") or {}).get("record") or {}
    if reference:
        report.window_set = reference["outputs"]["window_set"]["meta"]
        report.reference = reference["outputs"]["reference"]["meta"]
    report.variants = [_outcome(spec, outcomes, report, reg) for spec in plan.variants]
    return report


def _outcome(spec: Any, outcomes: dict[str, dict[str, Any]], report: ConvertReport, reg: Registry) -> VariantOutcome:
    out = VariantOutcome(variant=spec.name, format=str(spec.format))
    build, registered = outcomes[f"build:{spec.name}"], outcomes[f"register:{spec.name}"]
    if registered["status"] not in ("ran", "reused"):
        failed = next(o for o in (outcomes["resolve"], outcomes[f"prepare:{spec.format!s}"], build, registered)
                      if o["status"] not in ("ran", "reused"))
        out.status, out.error, out.error_type = "failed", failed.get("error"), "StageError"
        return out
    done = registered["record"]["outputs"]
    out.ref, out.created = done["ref"], bool(done.get("created")) and registered["status"] == "ran"
    out.status = "registered" if out.created else "reused"
    version = reg.get_version(out.ref)
    out.variant = version.variant  # the concrete name (an open EXL2 backend resolved on the build worker)
    out.size, out.bpw = version.size, (version.lineage.get("info") or {}).get("bpw")
    out.events = list(((build.get("record") or {}).get("outputs") or {}).get("events") or [])
    evaluation = outcomes.get(f"evaluate:{spec.name}:{format_info(out.format).engine!s}")
    if evaluation is None:
        return out
    if evaluation["status"] not in ("ran", "reused"):
        out.engine = str(format_info(out.format).engine)
        out.eval_status, out.eval_error = "failed", evaluation.get("error")
        return out
    # The engine that really ran (a reference engine stands in where the format's own cannot run).
    evaluated = ((evaluation.get("record") or {}).get("outputs") or {})
    engine = out.engine = evaluated.get("engine") or str(format_info(out.format).engine)
    ws_id = str((report.window_set or {}).get("id", ""))
    for r in version.results:
        if r.status == "ok" and r.engine == engine and r.kind == "quality" and r.window_set_id == ws_id:
            out.quality, out.engine_version = r.metrics, r.engine_version
        elif r.status == "ok" and r.engine == engine and r.kind == "speed":
            out.speed = r.metrics
    skipped = ((evaluation.get("record") or {}).get("outputs") or {}).get("skipped")
    out.eval_status = "skipped" if skipped else "ok" if evaluation["status"] == "ran" else "reused"
    out.eval_error = skipped or None
    return out


def _publish(report: ConvertReport) -> None:
    from prefect.artifacts import create_table_artifact

    slug = "".join(c if c.isalnum() else "-" for c in report.model.lower()).strip("-")
    columns = ("stage", "pool", "status", "key", "work_pool", "flow_run_id")
    stages = [{k: str(s.get(k))[:16] if k == "key" else s.get(k) for k in columns} for s in report.stages]
    create_table_artifact(stages, key=f"quantyard-stages-{slug}"[:100],
                          description=f"Quantyard stages for {report.model} ({report.source['identity']})")
    if report.variants:
        create_table_artifact(table_rows(report.variants), key=f"quantyard-results-{slug}"[:100],
                              description=f"Quantyard results for {report.model}")
