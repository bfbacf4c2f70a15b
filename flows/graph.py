"""The stage graph of a run: one definition, run by two executors.

::

    resolve ─┬─ prepare:FMT ── build:VARIANT ── register:VARIANT ─┬─ evaluate:VARIANT:ENGINE
             │                                                       └─ serve:VARIANT:ENGINE (with --serving)
             └─ reference ─────────────────────────────────────────┘

:func:`build_graph` turns a plan into stage requests (what each stage does, its ledger key, its pool,
the keys of the records it reads) with their dependencies. The stage bodies (``flows/stages.py``) do the
work of one stage and say what they made in a typed output model (below), recorded in the stage ledger
(``flows/ledger.py``) under the stage's key. Two executors run the same graph, the same bodies and the
same ledger:

* embedded (``flows/quantize.py``, ``quantyard convert``): every stage in this process, in this order (the
  llama.cpp evaluations of a run without speed several at once: flows/schedule.py);
* distributed (``flows/orchestrate.py``, ``quantyard orchestrate``): every stage a Prefect deployment run
  on the work pool its placement names, in parallel where the graph allows.

So either executor reuses what the other recorded, and :func:`settle` (reuse or skip, before running) and
:func:`report` (the run's ConvertReport from the stages' outcomes) are shared by both. :func:`decide` adds the
embedded executor's rule for feeder stages; flows/reuse.py applies it to a whole re-run before Prefect starts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from converters.lookup import converter_class
from evaluators.engines import engine_info, engines_of
from flows.ledger import StageRecord, find_stage, stage_key
from pipeline.errors import NotFoundError, StageError
from pipeline.formats import format_info
from pipeline.plan import Plan
from pipeline.recipe import Placement
from pipeline.results import ConvertReport, CrossCheck, VariantOutcome
from pipeline.shown import table_rows
from pipeline.specs import Frozen, SourceRef
from registry.store import Registry

StageName = Literal["resolve", "prepare", "build", "register", "reference", "evaluate", "serve"]
StageStatus = Literal["ran", "reused", "failed", "skipped", "not_needed"]
#: Upstream statuses a stage can run after (``not_needed``: every stage reading it was already recorded).
FINISHED: frozenset[str] = frozenset({"ran", "reused", "not_needed"})
#: Keys tried for one stage: the key itself, then retries when a recorded output vanished from the registry.
KEY_RETRIES = 4
#: Stages whose only purpose is to feed others: run only when a stage that reads them has to run.
FEEDERS: frozenset[str] = frozenset({"prepare", "reference"})


class StageRequest(Frozen):
    """What one stage run is asked to do. ``plan`` is restricted to what the stage needs (one format, one
    variant) and its source is pinned (a hub commit, or the folder whose content hash is
    ``source_identity``). ``upstream`` maps a role (resolve, prepare, build, register, reference) to the
    ledger key of the record this stage reads."""

    stage: StageName
    name: str
    key: str
    source_identity: str
    plan: Plan
    fmt: str | None = None
    variant: str | None = None
    engine: str | None = None
    upstream: dict[str, str] = Field(default_factory=dict)
    registry: str | None = None
    blobs: str | None = None
    pool: str = "cpu"
    #: The reference stage: the run builds a GGUF base, on which llama.cpp can measure the noise floor.
    gguf_base: bool = False

    def outcome(self, status: StageStatus, **facts: Any) -> StageOutcome:
        """This stage's outcome (:class:`StageOutcome`) with ``status`` and the given facts."""
        return StageOutcome(stage=self.name, pool=self.pool, key=self.key, status=status, **facts)


# --- what each stage records (StageRecord.outputs, typed) -----------------------------------------


class StageOutputs(BaseModel):
    """Base of the stage output models: only registry references and blob digests, never local paths.
    Unknown keys are ignored so that a record written by a later release still reads."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    events: list[str] = Field(default_factory=list)


class Blob(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    sha256: str
    size: int


class NamedBlob(Blob):
    name: str


class MetaBlob(Blob):
    meta: dict[str, Any] = Field(default_factory=dict)


class ResolveOutputs(StageOutputs):
    model: str
    architecture: str | None = None
    source: SourceRef
    torch_dtype: str | None = None
    n_params: int | None = None


class PrepareOutputs(StageOutputs):
    #: Prepared files other machines' builds need (FormatInfo.shared_prepared), by their Prepared.paths name.
    shared: dict[str, NamedBlob] = Field(default_factory=dict)
    meta: dict[str, Any] = Field(default_factory=dict)


class BuildOutputs(StageOutputs):
    variant: str  # the concrete name (an open EXL2 backend is resolved on the build machine)
    spec: dict[str, Any]
    build_key: str
    ref: str | None = None  # set when a version with this build key was already registered
    files: dict[str, Blob] = Field(default_factory=dict)
    lineage: dict[str, Any] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)


class RegisterOutputs(StageOutputs):
    ref: str
    created: bool = False


class ReferenceOutputs(StageOutputs):
    window_set: MetaBlob
    reference: MetaBlob
    #: The noise floor's summary (evaluators/reference.py ``run_noise_floor``), or why there is none; None in
    #: records written before it was measured.
    noise_floor: dict[str, Any] | None = None


class EvaluateOutputs(StageOutputs):
    ref: str
    engine: str
    fallback: str | None = None  # the format's own engine, when a reference engine stood in for it
    engine_version: str | None = None
    skipped: str | None = None  # why this engine cannot evaluate the variant (a cross-check)


class ServeOutputs(StageOutputs):
    ref: str
    engine: str
    engine_version: str | None = None
    skipped: str | None = None  # why the engine's server cannot run here (a failed result says so too)


OUTPUTS: dict[str, type[StageOutputs]] = {
    "resolve": ResolveOutputs, "prepare": PrepareOutputs, "build": BuildOutputs, "register": RegisterOutputs,
    "reference": ReferenceOutputs, "evaluate": EvaluateOutputs, "serve": ServeOutputs}


def outputs_of(record: StageRecord, stage: str) -> Any:
    """``record``'s outputs as the model of ``stage`` (one of :data:`OUTPUTS`)."""
    return OUTPUTS[stage].model_validate(record.outputs)


# --- the graph ------------------------------------------------------------------------------------


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

    def dependents(self, name: str) -> list[str]:
        return [n for n, node in self.nodes.items() if name in node.deps]


def _prepare_spec(fmt: str, plan: Plan, specs: list[Any]) -> dict[str, Any]:
    """What a format's shared preparation depends on: the converter says (``prepare_inputs``; GGUF: the base
    type, and the imatrix calibration when a variant needs one, so adding a type reuses the base), else every
    variant of the format."""
    cls = converter_class(fmt)
    if hasattr(cls, "prepare_inputs"):
        return dict(cls.prepare_inputs(plan.build_options(fmt), specs))
    return {"specs": [s.model_dump(mode="json") for s in specs]}


#: EvalSpec fields that are not part of any stage's key: why an automatic reference was chosen (it names the
#: memory available at the time) says how the engine was chosen, not what the reference computes.
UNKEYED_EVAL = frozenset({"reference_reason", "noise_floor"})


def _eval_spec(plan: Plan) -> dict[str, Any]:
    spec = plan.eval.model_dump(mode="json", exclude={"speed", "cross_check", "enabled", *UNKEYED_EVAL})
    return {"eval": spec, "text_sha256": _text_digest(plan.eval.text_file)}


def _text_digest(path: str | None) -> str | None:
    if not path or not Path(path).is_file():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_graph(plan: Plan, identity: str, placement: Placement, target: dict[str, str | None],
                nonce: str | None = None) -> Graph:
    """Every stage of ``plan`` with its key, pool, request and dependencies, in a topological order that
    one process can run as it is (builds before the reference, so a run whose builds all fail computes
    no reference). ``nonce`` (``--force``) makes build, register and evaluation keys unique to this run."""
    graph = Graph(identity)

    def request(stage: StageName, name: str, spec: dict[str, Any], tools: list[str], pool: str, sub: Plan,
                upstream: dict[str, str], **kw: Any) -> StageRequest:
        if stage in ("build", "register", "evaluate", "serve"):
            # what these record is a version of one model: the same source under another name is another one
            spec = {**spec, "model": plan.model_name, **({"nonce": nonce} if nonce else {})}
        key = stage_key(identity, stage, spec, tools)
        return StageRequest(stage=stage, name=name, key=key, source_identity=identity, plan=sub, upstream=upstream,
                            pool=pool, registry=target.get("registry"), blobs=target.get("blobs"), **kw)

    bare = plan.model_copy(update={"variants": ()})
    res = request("resolve", "resolve", {"source": plan.source.model_dump(mode="json"), "name": plan.model_name},
                  [], placement.resolve, bare, {})
    graph.add(res)
    up = {"resolve": res.key}
    registered: list[tuple[str, Any, StageRequest]] = []
    for fmt, specs in plan.by_format().items():
        pool = placement.for_format(fmt)
        fmt_plan = plan.model_copy(update={"variants": tuple(specs)})
        prep = request("prepare", f"prepare:{fmt}", {"format": fmt, **_prepare_spec(fmt, plan, specs)}, [fmt],
                       pool, fmt_plan, up, fmt=fmt)
        graph.add(prep, ("resolve",))
        for spec in specs:
            one = plan.model_copy(update={"variants": (spec,)})
            build_spec = {"spec": spec.model_dump(mode="json"), "options": plan.build_options(fmt), "prepare": prep.key}
            build = request("build", f"build:{spec.name}", build_spec, [fmt], pool, one,
                            {**up, "prepare": prep.key}, fmt=fmt, variant=spec.name)
            graph.add(build, (prep.name,))
            reg = request("register", f"register:{spec.name}", {"build": build.key, "force": plan.force}, [],
                          placement.registration, one, {**up, "build": build.key}, fmt=fmt, variant=spec.name)
            graph.add(reg, (build.name,))
            registered.append((fmt, spec, reg))
    if plan.eval.enabled:
        ref = request("reference", "reference", _eval_spec(plan), [], placement.for_reference(plan.eval), bare, up,
                      gguf_base=any("base" in format_info(s.format).shared_prepared for s in plan.variants))
        graph.add(ref, ("resolve",))
        for fmt, spec, reg in registered:
            one = plan.model_copy(update={"variants": (spec,)})
            for engine in engines_of(fmt, plan.eval.cross_check):
                ev = request("evaluate", f"evaluate:{spec.name}:{engine}",
                             {"register": reg.key, "engine": engine, **_eval_spec(plan),
                              "eval_all": plan.eval.model_dump(mode="json", exclude=set(UNKEYED_EVAL))}, [engine],
                             placement.for_engine(engine, engine_info(engine).pool), one,
                             {**up, "register": reg.key, "reference": ref.key}, fmt=fmt, variant=spec.name,
                             engine=engine)
                graph.add(ev, (reg.name, ref.name))
    if plan.serving.enabled:
        for fmt, spec, reg in registered:
            engine = str(format_info(fmt).engine)
            serve = request("serve", f"serve:{spec.name}:{engine}",
                            {"register": reg.key, "engine": engine, "serving": plan.serving.model_dump(mode="json")},
                            [engine, "guidellm"], placement.for_engine(engine, engine_info(engine).pool),
                            plan.model_copy(update={"variants": (spec,)}), {**up, "register": reg.key}, fmt=fmt,
                            variant=spec.name, engine=engine)
            graph.add(serve, (reg.name,))
    return graph


# --- one stage's outcome, and the decision both executors make before running it --------------------


class StageOutcome(BaseModel):
    """How one stage of a run ended, and its ledger record when it finished (ran or reused)."""

    stage: str
    pool: str
    key: str
    status: StageStatus
    record: StageRecord | None = None
    error: str | None = None
    error_type: str | None = None  # the error's class where the stage ran in this process, else StageError
    flow_run_id: str | None = None
    work_pool: str | None = None
    dispatch_s: float | None = None
    start_s: float | None = None  # when it started, in seconds after the first stage of the run (embedded)

    def outputs(self) -> Any:
        """The record's typed outputs (see :data:`OUTPUTS`); None when the stage did not finish."""
        return None if self.record is None else outputs_of(self.record, self.stage.split(":", 1)[0])


def _still_there(reg: Registry, record: StageRecord) -> bool:
    """Whether a recorded stage's outputs are still in the registry (a version, blobs, artifacts)."""
    out = record.outputs
    try:
        if out.get("ref"):
            reg.get_version(out["ref"])
    except NotFoundError:
        return False
    blobs = [*(out.get("files") or {}).values(), *(out.get("shared") or {}).values()]
    blobs += [out[k] for k in ("window_set", "reference") if out.get(k)]
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


def settle(reg: Registry, request: StageRequest,
           upstream: list[StageOutcome]) -> tuple[StageOutcome | None, StageRequest]:
    """Before running a stage: ``skipped`` if an upstream stage did not finish, ``reused`` if the ledger
    holds its key with outputs still present; else ``None`` and the request to run (its key may have moved)."""
    blocked = [u for u in upstream if u.status not in FINISHED]
    if blocked:
        why = "; ".join(f"{u.stage}: {u.error}" for u in blocked if u.error)  # the reason, not only its place
        error = f"upstream {', '.join(u.stage for u in blocked)} did not finish" + (f" ({why})" if why else "")
        return request.outcome("skipped", error=error), request
    record, request = reusable(reg, request)
    if record is not None:
        return request.outcome("reused", record=record), request
    return None, request


def needed(reg: Registry, graph: Graph, name: str, outcomes: dict[str, StageOutcome]) -> bool:
    """Whether stage ``name`` must run in a run that goes through the graph in order (the embedded executor):
    a stage that is not a feeder always; a feeder only when some stage reading it is not recorded and can run
    (its other upstream stages finished, or are still to come)."""
    if graph.nodes[name].request.stage not in FEEDERS:
        return True
    for dependent in graph.dependents(name):
        node = graph.nodes[dependent]
        others = [outcomes[d].status for d in node.deps if d != name and d in outcomes]
        if all(s in FINISHED for s in others) and reusable(reg, node.request)[0] is None:
            return True
    return False


def decide(reg: Registry, graph: Graph, name: str,
           outcomes: dict[str, StageOutcome]) -> tuple[StageOutcome | None, StageRequest]:
    """What a run going through the graph in order does with stage ``name``, given the outcomes of the stages
    before it: its outcome without running it (skipped, reused, or ``not_needed`` for a feeder no stage to
    run reads), or ``None`` and the request to run."""
    node = graph.nodes[name]
    settled, request = settle(reg, node.request, [outcomes[d] for d in node.deps])
    if settled is None and not needed(reg, graph, name, outcomes):
        settled = request.outcome("not_needed")
    return settled, request


# --- the run's report, from its stages ------------------------------------------------------------

#: What a stage's recorded events become in the report (``EVENT:SUBJECT``; the subject is the variant, or
#: the format for a preparation); events not listed keep their name.
_RENAMED = {"reuse_version": "reuse", "register": None, "reuse_result": None}


def _events(graph: Graph, name: str, outcome: StageOutcome) -> list[str]:
    request = graph.nodes[name].request
    subject = request.variant or request.fmt
    suffix = f":{subject}" if subject else ""
    cross = request.stage == "evaluate" and request.engine != str(format_info(request.fmt or "").engine)
    if outcome.status == "failed":
        if request.stage == "evaluate":
            return [f"{'cross_check_failed' if cross else 'eval_failed'}{suffix}"]
        return [f"failed{suffix}"] if request.variant else []
    if outcome.status == "reused":
        return [f"reuse{suffix}"] if request.stage == "build" else []
    if outcome.status != "ran":
        return []
    out = outcome.outputs()
    if request.stage == "evaluate" and out.skipped:
        return [f"cross_check_skipped{suffix}"]
    events = []
    for event in out.events:
        renamed = _RENAMED.get(event, event)
        if renamed is None:
            continue
        if request.stage == "evaluate" and cross:
            renamed = "cross_check"
        events.append(f"{renamed}{suffix}")
    return events


def report(plan: Plan, source: SourceRef, graph: Graph, outcomes: dict[str, StageOutcome],
           reg: Registry) -> ConvertReport:
    """The run's report: events (see :func:`_events`), one entry per stage, and one outcome per variant."""
    resolved = outcomes["resolve"].outputs()
    out = ConvertReport(model=resolved.model if resolved else plan.model_name or "?",
                        source={"identity": graph.identity, "path": source.path or None, "repo_id": source.repo_id,
                                "commit": source.commit})
    for name, outcome in outcomes.items():
        record = outcome.record
        entry = outcome.model_dump(mode="json", exclude={"record"})
        entry.update(work_s=record.work_s if record else None, wall_s=record.wall_s if record else None,
                     usage=record.usage if record else None, deps=list(graph.nodes[name].deps))
        out.stages.append(entry)
        out.events.extend(_events(graph, name, outcome))
        if outcome.status == "ran":
            out.stage_s[name] = float(outcome.dispatch_s or 0.0)
    reference = outcomes.get("reference")
    evidence = reference.outputs() if reference is not None else None
    if evidence is not None:
        out.window_set, out.reference = evidence.window_set.meta, evidence.reference.meta
        out.noise_floor = evidence.noise_floor
    out.variants = [_variant(spec, graph, outcomes, out, reg) for spec in plan.variants]
    return out


def _variant(spec: Any, graph: Graph, outcomes: dict[str, StageOutcome], report: ConvertReport,
             reg: Registry) -> VariantOutcome:
    out = VariantOutcome(variant=spec.name, format=str(spec.format))
    build, registered = outcomes[f"build:{spec.name}"], outcomes[f"register:{spec.name}"]
    if registered.status not in ("ran", "reused"):
        chain = (outcomes["resolve"], outcomes[f"prepare:{spec.format!s}"], build, registered)
        failed = next((o for o in chain if o.status == "failed"), registered)
        out.status, out.error, out.error_type = "failed", failed.error, failed.error_type or "StageError"
        return out
    done = registered.outputs()
    out.ref, out.created = done.ref, done.created and registered.status == "ran"
    out.status = "registered" if out.created else "reused"
    version = reg.get_version(done.ref)
    out.variant = version.variant  # the concrete name (an open EXL2 backend resolved on the build worker)
    out.size, out.bpw = version.size, (version.lineage.get("info") or {}).get("bpw")
    out.notes = list((version.lineage.get("parameters") or {}).get("llama_cpp_divergences") or [])
    built = build.outputs()
    out.events = [] if built is None else list(built.events)
    default = str(format_info(out.format).engine)
    for engine in engines_of(out.format, True):
        evaluation = outcomes.get(f"evaluate:{spec.name}:{engine}")
        if evaluation is None:
            continue
        if engine == default:
            _own_engine(out, evaluation, version, report)
        elif evaluation.status == "failed":  # said after the own engine's error or skip, never instead of it
            said = f"cross-check on {engine}: {evaluation.error}"
            out.eval_error = f"{out.eval_error}; {said}" if out.eval_error else said
        else:
            _cross_check(out, engine, version, report)
    return out


def _cross_check(out: VariantOutcome, engine: str, version: Any, report: ConvertReport) -> None:
    """A cross-check engine's quality result on this run's window set: a second figure of the variant."""
    ws_id = str((report.window_set or {}).get("id", ""))
    found = [r for r in version.results if r.status == "ok" and r.engine == engine and r.kind == "quality"
             and r.window_set_id == ws_id]
    if found:
        out.cross_checks.append(CrossCheck(engine=engine, engine_version=found[-1].engine_version,
                                           window_set_id=ws_id, quality=found[-1].metrics))


def _own_engine(out: VariantOutcome, evaluation: StageOutcome, version: Any, report: ConvertReport) -> None:
    """The variant's evaluation on its format's engine (or the reference engine standing in for it)."""
    if evaluation.status not in ("ran", "reused"):
        out.engine = str(format_info(out.format).engine)
        out.eval_status, out.eval_error = "failed", evaluation.error
        return
    evaluated = evaluation.outputs()
    engine = out.engine = evaluated.engine
    ws_id = str((report.window_set or {}).get("id", ""))
    for r in version.results:
        if r.status == "ok" and r.engine == engine and r.kind == "quality" and r.window_set_id == ws_id:
            out.quality, out.engine_version, out.window_set_id = r.metrics, r.engine_version, ws_id
        elif r.status == "ok" and r.engine == engine and r.kind == "speed":
            out.speed, out.speed_engine = r.metrics, engine
    reused = evaluation.status == "reused" or "reuse_result" in evaluated.events
    out.eval_status = "skipped" if evaluated.skipped else "reused" if reused else "ok"
    out.eval_error = evaluated.skipped or None


def publish(report: ConvertReport) -> None:
    """The run's stages and results as Prefect table artifacts (both executors)."""
    from prefect.artifacts import create_table_artifact

    slug = "".join(c if c.isalnum() else "-" for c in report.model.lower()).strip("-")
    columns = ("stage", "pool", "status", "key", "work_pool", "flow_run_id")
    stages = [{k: str(s.get(k))[:16] if k == "key" else s.get(k) for k in columns} for s in report.stages]
    create_table_artifact(stages, key=f"quantyard-stages-{slug}"[:100],
                          description=f"Quantyard stages for {report.model} ({report.source['identity']})")
    if report.variants:
        create_table_artifact(table_rows(report.variants), key=f"quantyard-results-{slug}"[:100],
                              description=f"Quantyard results for {report.model} ({report.source['identity']})")


__all__ = ["FEEDERS", "FINISHED", "OUTPUTS", "Graph", "Node", "StageName", "StageOutcome", "StageRequest",
           "build_graph", "decide", "needed", "outputs_of", "publish", "report", "reusable", "settle"]
