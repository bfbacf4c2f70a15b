"""The stage bodies and the stage flows: what each stage of the graph (flows/graph.py) does.

A body does one stage's work with the plain step functions of ``flows.steps`` and returns what it made as
the stage's output model (flows/graph.py); :func:`run_stage` records that in the stage ledger
(flows/ledger.py) under the stage's key, unless the key is already there. Both executors call it: the
embedded one (flows/quantize.py) in this process, the distributed one (flows/orchestrate.py) through the
stage flows at the bottom of this module, which ``quantyard deploy`` registers as deployments on the CPU
and on the GPU work pool (flows/deployments.py).

Stages exchange only registry references and blob digests, through the ledger: a stage reads its upstream
stages' records, does its work on whatever machine runs it, puts the files it made into the blob store and
records its outputs. So in a distributed run every worker must reach the same registry (PostgreSQL + object
storage, or a shared filesystem) and, for a folder source, the same folder; a hub source is downloaded by
each machine into its own HF cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from converters.base import Prepared
from evaluators.engines import engine_for, get_evaluator
from evaluators.reference import reference_key
from flows import steps
from flows.graph import (
    Blob,
    BuildOutputs,
    EvaluateOutputs,
    MetaBlob,
    NamedBlob,
    PrepareOutputs,
    ReferenceOutputs,
    RegisterOutputs,
    ResolveOutputs,
    ServeOutputs,
    StageOutputs,
    StageRequest,
    outputs_of,
)
from flows.ledger import StageRecord, Stopwatch, find_stage, record_stage
from pipeline import workdir
from pipeline.config import Settings
from pipeline.errors import ConfigError, StageError, ToolchainMissingError
from pipeline.formats import format_info
from pipeline.plan import Plan
from pipeline.progress import Event, Throttle, describe, listening, stage
from pipeline.resources import Sampler
from pipeline.specs import SourceRef
from registry import open_registry
from registry.blobs import StoredBlob
from registry.store import RegisterRequest, Registry

#: Stages that hold a slot of their pool's concurrency limit while they work.
HEAVY_STAGES: frozenset[str] = frozenset({"prepare", "build", "reference", "evaluate", "serve"})
#: Stages an embedded run records only once a later stage starts (InProcess.pending).
SOURCE_STAGES: frozenset[str] = frozenset({"resolve", "prepare"})
#: Stages whose body runs while those records are written (InProcess.flushed_beside): their bodies read none.
FLUSHED_BESIDE: frozenset[str] = frozenset({"build"})
Who = tuple[str, str | None, SourceRef]


@dataclass
class InProcess:
    """What the embedded executor hands every stage of one run in its process: the caller's Settings, the
    source it resolved and validated once, and each format's preparation as made here (so a build uses the
    prepared files where they are instead of linking them back from the blob store)."""

    settings: Settings
    resolved: steps.Resolved
    prepared: dict[str, Prepared] = field(default_factory=dict)  # by prepare-stage key
    #: Records of the stages that touch nothing but the source (resolve, prepare), written to the ledger
    #: only when a later stage starts: a source that fails its checks or its preparation (bad input) leaves
    #: the registry exactly as it was.
    pending: list[tuple[StageRequest, StageRecord, Who]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)  # the run's start (StageOutcome.start_s)

    def flush(self, reg: Registry) -> None:
        """Write the pending records (a preparation's shared files first, into the blob store)."""
        for request, record, (model, architecture, source) in self.pending:
            if request.stage == "prepare":
                shared = _share(reg, request, self.resolved, self.prepared[request.key])
                outputs = {**record.outputs, "shared": {k: v.model_dump(mode="json") for k, v in shared.items()}}
                record = record.model_copy(update={"outputs": outputs})
            with steps.scratch_dir(self.settings) as tmp:
                record_stage(reg, model=model, architecture=architecture, source=source, record=record,
                             scratch=Path(tmp))
        self.pending.clear()

    @contextmanager
    def flushed_beside(self, reg: Registry, logger: logging.Logger | logging.LoggerAdapter[Any]) -> Iterator[None]:
        """The pending records written in a thread while the block runs, waited for when it ends (a build's body
        reads none of them: it takes the source and the preparation from this object). Putting a base into
        the blob store hashes it and syncs it to disk (1.5 GB: about 1.0 s and 0.4 s here), which so runs beside
        the first quantization instead of before it. An error of the block is the one raised (a failed write
        is logged and stays pending: the next stage's flush tries it again); a write that failed after the
        block succeeded is raised, so no record of the block is written before the records it follows.
        On KeyboardInterrupt or SystemExit the block's exit does not wait: the thread is a daemon, and a
        record is written whole or not at all, as when a process is killed in a flush."""
        if not self.pending:
            yield
            return
        failed: list[BaseException] = []

        def write() -> None:
            try:
                self.flush(reg)
            except BaseException as exc:  # handed to the block's end below
                failed.append(exc)

        thread = threading.Thread(target=write, name="quantyard-flush", daemon=True)
        thread.start()
        try:
            yield
        except Exception:
            thread.join()
            if failed:
                logger.warning("writing the source's records beside the stage failed as well (it "
                                         "stays pending): %s: %s", type(failed[0]).__name__, failed[0])
            raise
        thread.join()
        if failed:
            raise failed[0]


@dataclass
class StageContext:
    request: StageRequest
    settings: Settings
    reg: Registry
    scratch: Path
    watch: Stopwatch
    here: InProcess | None = None

    def upstream(self, role: str) -> StageRecord:
        key = self.request.upstream.get(role)
        record = find_stage(self.reg, self.request.source_identity, key) if key else None
        if record is None:
            raise StageError(f"stage {self.request.name} needs the {role} stage's record (key {str(key)[:16]}), "
                             "which is not in the registry's ledger",
                             hint="run the whole orchestration (quantyard orchestrate), not a single stage")
        return record

    def rows(self) -> tuple[str, str | None, SourceRef]:
        """Model, architecture and source for the registry rows of this run (from the resolve record)."""
        out: ResolveOutputs = outputs_of(self.upstream("resolve"), "resolve")
        return out.model, out.architecture, out.source


Body = Callable[[StageContext], tuple[StageOutputs, Who]]


@contextmanager
def progress_to_log(logger: logging.Logger | logging.LoggerAdapter[Any], stage: str, detail: str) -> Iterator[None]:
    """Progress of this stage's tools (tensor i of N, window i of N: pipeline/progress.py) as lines of its run log,
    each tenth of the way or each minute."""
    clock = Throttle()
    clock.due(Event(stage, detail, "start"))

    def on_event(ev: Event) -> None:
        if (ev.stage, ev.detail) == (stage, detail) and clock.due(ev):
            logger.info("%s %s: %s", stage, detail, describe(ev, clock.elapsed(ev)))

    with listening(on_event):
        yield


def stage_settings(request: StageRequest) -> Settings:
    """This worker's Settings (its environment), pointed at the run's registry and blob store."""
    overrides = {k: v for k, v in (("registry", request.registry), ("blobs", request.blobs)) if v}
    return Settings(**overrides)  # type: ignore[arg-type]


@contextmanager
def _slot(name: str | None) -> Iterator[None]:
    """Hold one slot of the pool's Prefect concurrency limit (one heavy job per GPU)."""
    if not name:
        yield
        return
    from prefect.concurrency.sync import concurrency

    with concurrency(name, occupy=1, strict=False):
        yield


@contextmanager
def _announced(request: StageRequest, logger: logging.Logger | logging.LoggerAdapter[Any], own: bool) -> Iterator[None]:
    """On a worker (``own``), the stage's progress events and their lines in its run log; the embedded executor
    announces its stages itself (flows/quantize.py)."""
    if not own:
        yield
        return
    detail = request.variant or request.fmt or ""
    with stage(request.stage, detail), progress_to_log(logger, request.stage, detail):
        yield


def run_stage(request: StageRequest, slot: str | None, body: Body, here: InProcess | None = None) -> StageRecord:
    """Run ``body`` unless the ledger already holds ``request.key``; record its outputs under the key.
    ``here``: the embedded executor's run (its Settings, resolved source and preparations); without it the
    stage builds its Settings from this worker's environment."""
    logger = get_run_logger()
    settings = here.settings if here is not None else stage_settings(request)
    reg = open_registry(settings)
    beside = here is not None and request.stage in FLUSHED_BESIDE
    if here is not None and request.stage not in SOURCE_STAGES and not beside:
        here.flush(reg)
    done = find_stage(reg, request.source_identity, request.key)
    if done is not None:
        logger.info("stage %s key %s: already recorded by flow run %s, nothing to do", request.name,
                    request.key[:16], done.flow_run_id)
        return done
    t0 = time.perf_counter()
    watch = Stopwatch()
    held = slot if request.stage in HEAVY_STAGES else None
    with workdir.lease(settings.work_root), steps.scratch_dir(settings) as tmp, _slot(held):
        ctx = StageContext(request=request, settings=settings, reg=reg, scratch=Path(tmp), watch=watch, here=here)
        with (here.flushed_beside(reg, logger) if here is not None and beside else nullcontext(),
              _announced(request, logger, here is None), Sampler() as sampler):
            outputs, (model, architecture, source) = body(ctx)
        record = StageRecord(stage=request.name, key=request.key, pool=request.pool,
                             outputs=outputs.model_dump(mode="json"), work_s=watch.total,
                             wall_s=time.perf_counter() - t0, flow_run_id=_flow_run_id(), slot=held,
                             usage=sampler.usage.as_dict() if sampler.usage is not None else None)
        if here is not None and request.stage in SOURCE_STAGES:
            here.pending.append((request, record, (model, architecture, source)))
            return record
        record = record_stage(reg, model=model, architecture=architecture, source=source, record=record,
                              scratch=Path(tmp))
    logger.info("stage %s key %s: done, work %.2f s of %.2f s (events: %s)", request.name, request.key[:16],
                record.work_s, record.wall_s, ",".join(outputs.events) or "none")
    return record


def _flow_run_id() -> str | None:
    value = flow_run.get_id()
    return str(value) if value else None


# --- stage bodies ---------------------------------------------------------------------------------


def _resolved(ctx: StageContext) -> steps.Resolved:
    """The source on this machine (downloaded into its HF cache for a hub source), checked to be the
    exact one the run was planned for; the embedded executor's, resolved once for the whole run."""
    if ctx.here is not None:
        resolved = ctx.here.resolved
    else:
        with ctx.watch:
            resolved = steps.resolve(ctx.request.plan, ctx.settings)
    if resolved.source.identity != ctx.request.source_identity:
        raise ConfigError(f"the source resolved here to {resolved.source.identity}, the run was planned for "
                          f"{ctx.request.source_identity}",
                          hint="the folder changed while the run was going, or this worker sees a different "
                               "folder: start the run again")
    return resolved


def _who(resolved: steps.Resolved) -> Who:
    return resolved.model_name, resolved.architecture, resolved.source


def _resolve_body(ctx: StageContext) -> tuple[ResolveOutputs, Who]:
    resolved = _resolved(ctx)
    ck = resolved.checkpoint
    outputs = ResolveOutputs(model=resolved.model_name, architecture=resolved.architecture, source=resolved.source,
                             torch_dtype=ck.torch_dtype, n_params=ck.n_params)
    return outputs, _who(resolved)


def _prepare_body(ctx: StageContext) -> tuple[PrepareOutputs, Who]:
    req = ctx.request
    assert req.fmt is not None
    resolved = _resolved(ctx)
    with ctx.watch:
        prepared = steps.prepare_format(req.fmt, req.plan, resolved, list(req.plan.variants), ctx.settings)
    if ctx.here is not None:  # shared when the record is written (InProcess.flush)
        ctx.here.prepared[req.key] = prepared
        shared = {}
    else:
        shared = _share(ctx.reg, req, resolved, prepared)
    return PrepareOutputs(shared=shared, meta=prepared.meta, events=prepared.events), _who(resolved)


def _share(reg: Registry, req: StageRequest, resolved: steps.Resolved, prepared: Prepared) -> dict[str, NamedBlob]:
    """Files of a preparation that builds on other machines need (FormatInfo.shared_prepared), by their
    Prepared.paths name: put in the blob store (found again by digest)."""
    assert req.fmt is not None
    shared = {}
    for name in format_info(req.fmt).shared_prepared:
        if name not in prepared.paths:
            continue
        path = Path(prepared.paths[name])
        art = reg.put_source_artifact(model=resolved.model_name, architecture=resolved.architecture,
                                      source=resolved.source, kind=f"{req.fmt}_{name}", key=req.key,
                                      name=path.name, path=path, meta={"stage": req.name})
        shared[name] = NamedBlob(name=path.name, sha256=art.sha256, size=art.size)
    return shared


def _prepared_here(ctx: StageContext, resolved: steps.Resolved) -> Prepared:
    """The format's preparation on this machine: the embedded run's own, the shared files from the blob
    store (linked under their own names), or, for a format whose preparation is per machine, prepared here."""
    req = ctx.request
    assert req.fmt is not None
    key = req.upstream.get("prepare")
    if ctx.here is not None and key in ctx.here.prepared:
        return ctx.here.prepared[key]
    if not format_info(req.fmt).shared_prepared:  # prepared per machine (AWQ: the tool environment is)
        with ctx.watch:
            prepared = steps.prepare_format(req.fmt, req.plan, resolved, list(req.plan.variants), ctx.settings)
        if ctx.here is not None and key is not None:
            ctx.here.prepared[key] = prepared
        return prepared
    recorded: PrepareOutputs = outputs_of(ctx.upstream("prepare"), "prepare")
    folder = ctx.scratch / "prepared"
    folder.mkdir()
    paths = {}
    for name, blob in recorded.shared.items():
        link = folder / blob.name
        link.symlink_to(ctx.reg.local_blob(blob.sha256, blob.size))
        paths[name] = str(link)
    return Prepared(paths=paths, meta=dict(recorded.meta))


def variant_build_key(fmt: str, plan: Plan, resolved: steps.Resolved, spec: Any, settings: Settings) -> str:
    """The registry build key of ``spec`` (the same on every machine, so either executor reuses the other's)."""
    tool = steps.tool_identity(fmt, plan, settings, spec)
    return steps.build_key(resolved.source, spec, tool, steps.build_inputs(plan, resolved, spec, settings))


def _build_body(ctx: StageContext) -> tuple[BuildOutputs, Who]:
    req = ctx.request
    assert req.fmt is not None
    resolved = _resolved(ctx)
    # A spec that leaves its backend open (EXL2 "auto") is made concrete here, on the machine that builds
    # it: its name, key and lineage say which backend this worker has (ExLlamaV2 on CUDA, or reference-cpu).
    plan = steps.resolve_backends(req.plan, ctx.settings)
    (spec,) = plan.variants
    concrete = {"variant": spec.name, "spec": spec.model_dump(mode="json")}
    key = variant_build_key(req.fmt, plan, resolved, spec, ctx.settings)
    existing = None if plan.force else steps.find_existing(ctx.settings, resolved, spec, key)
    if existing is not None:
        return BuildOutputs(ref=existing.ref, build_key=key, events=["reuse_version"], **concrete), _who(resolved)
    steps.sweep_stale(ctx.settings)
    prepared = _prepared_here(ctx, resolved)
    with steps.scratch_dir(ctx.settings, "staging") as staging:
        with ctx.watch, Sampler() as sampler:
            built = steps.build_variant(req.fmt, plan, resolved, prepared, spec, ctx.settings, Path(staging))
        files = {}
        for name, path in built.files.items():
            blob = ctx.reg.blobs.put_file(path)
            files[name] = Blob(sha256=blob.sha256, size=blob.size)
    lineage = steps.lineage(plan, resolved, spec, built, key)
    if sampler.usage is not None:  # what building it took: what a user plans the next one by
        lineage["usage"] = sampler.usage.as_dict()
    outputs = BuildOutputs(build_key=key, files=files, lineage=lineage, events=list(built.events), info=built.info,
                           **concrete)
    return outputs, _who(resolved)


def _register_body(ctx: StageContext) -> tuple[RegisterOutputs, Who]:
    req = ctx.request
    model, architecture, source = who = ctx.rows()
    build: BuildOutputs = outputs_of(ctx.upstream("build"), "build")
    if build.ref is not None:
        return RegisterOutputs(ref=build.ref, created=False), who
    stored = {name: StoredBlob(sha256=b.sha256, size=b.size, created=False) for name, b in build.files.items()}
    request = RegisterRequest(model=model, architecture=architecture, source=source, variant=build.variant,
                              format=req.fmt or "", spec=build.spec, build_key=build.build_key,
                              lineage=build.lineage, files={}, force=req.plan.force)
    view = ctx.reg.register_stored(request, stored)
    return RegisterOutputs(ref=view.ref, created=view.created, events=["register"] if view.created else []), who


def _reference_body(ctx: StageContext) -> tuple[ReferenceOutputs, Who]:
    resolved = _resolved(ctx)
    spec = ctx.request.plan.eval
    with ctx.watch:
        windows, ws_meta, built = steps.ensure_window_set(ctx.settings, resolved, spec)
        ref_path, ref_meta, computed = steps.ensure_reference(ctx.settings, resolved, windows, ws_meta, spec)
        floor = steps.ensure_noise_floor(ctx.settings, resolved, windows, ws_meta, ref_path, spec,
                                         ctx.request.plan.gguf.base_type if ctx.request.gguf_base else None)
    ws_art = next(a for a in ctx.reg.list_source_artifacts(resolved.source.identity, "window_set")
                  if a.meta.get("id") == ws_meta["id"])
    ref_art = ctx.reg.find_source_artifact(resolved.source, "reference", reference_key(str(ws_meta["id"]), spec))
    assert ref_art is not None
    events = (["window_set"] if built else []) + (["reference"] if computed else [])
    outputs = ReferenceOutputs(window_set=MetaBlob(sha256=ws_art.sha256, size=ws_art.size, meta=ws_meta),
                               reference=MetaBlob(sha256=ref_art.sha256, size=ref_art.size, meta=ref_meta),
                               noise_floor=floor, events=events)
    return outputs, _who(resolved)


def _evaluate_body(ctx: StageContext) -> tuple[EvaluateOutputs, Who]:
    req = ctx.request
    assert req.fmt is not None and req.engine is not None
    who = ctx.rows()
    ref = outputs_of(ctx.upstream("register"), "register").ref
    evidence: ReferenceOutputs = outputs_of(ctx.upstream("reference"), "reference")
    ws, rf = evidence.window_set, evidence.reference
    version = ctx.reg.get_version(ref)
    default = str(format_info(req.fmt).engine)
    if req.engine == default:  # the format's engine, or the reference engine standing in for it on this machine
        engine, fallback = engine_for(req.fmt, ctx.settings)
    else:
        engine, fallback = req.engine, None
        reason = get_evaluator(engine).skip_reason(version.spec)
        if reason:
            return EvaluateOutputs(ref=ref, engine=engine, skipped=reason), who
    if steps.has_quality_result(version, engine, str(ws.meta["id"]), reference_key(str(ws.meta["id"]), req.plan.eval)):
        return EvaluateOutputs(ref=ref, engine=engine, fallback=fallback, events=["reuse_result"]), who
    windows = ctx.reg.local_blob(ws.sha256, ws.size)
    reference = ctx.reg.local_blob(rf.sha256, rf.size)
    with ctx.watch:
        outcome = steps.evaluate_version(ctx.settings, ref, req.fmt, windows, ws.meta, reference, req.plan.eval,
                                         None if req.engine == default else engine)
    return EvaluateOutputs(ref=ref, engine=outcome.engine, fallback=fallback, engine_version=outcome.engine_version,
                           events=["evaluate"]), who


def _serve_body(ctx: StageContext) -> tuple[ServeOutputs, Who]:
    """The variant behind its engine's server under GuideLLM's load (flows/serving.py); where the engine
    cannot run here, a failed result says so and the stage is skipped, never faked."""
    from flows.serving import serve_version

    req = ctx.request
    assert req.engine is not None
    who = ctx.rows()
    ref = outputs_of(ctx.upstream("register"), "register").ref
    try:
        with ctx.watch:
            result = serve_version(ctx.settings, ref, req.plan.serving, ctx.scratch)
    except ToolchainMissingError as exc:
        return ServeOutputs(ref=ref, engine=req.engine, skipped=exc.summary()), who
    return ServeOutputs(ref=ref, engine=req.engine, engine_version=result.engine_version, events=["serve"]), who


BODIES: dict[str, Body] = {"resolve": _resolve_body, "prepare": _prepare_body, "build": _build_body,
                           "register": _register_body, "reference": _reference_body, "evaluate": _evaluate_body,
                           "serve": _serve_body}


# --- the stage flows (one per stage; deployed once per pool) --------------------------------------


@flow(name="quantyard-resolve", flow_run_name="{request.name}", log_prints=True)
def resolve_stage(request: StageRequest, slot: str | None = None) -> dict[str, Any]:
    """Pin, download (hub) and validate the source; record the checkpoint's facts."""
    return run_stage(request, slot, _resolve_body).model_dump(mode="json")


@flow(name="quantyard-prepare", flow_run_name="{request.name}", log_prints=True)
def prepare_stage(request: StageRequest, slot: str | None = None) -> dict[str, Any]:
    """A format's shared work (the GGUF F16/BF16 base, the imatrix), put in the blob store."""
    return run_stage(request, slot, _prepare_body).model_dump(mode="json")


@flow(name="quantyard-build", flow_run_name="{request.name}", log_prints=True)
def build_stage(request: StageRequest, slot: str | None = None) -> dict[str, Any]:
    """Convert or quantize one variant; its files go to the blob store (registered by the register stage)."""
    return run_stage(request, slot, _build_body).model_dump(mode="json")


@flow(name="quantyard-register", flow_run_name="{request.name}", log_prints=True)
def register_stage(request: StageRequest, slot: str | None = None) -> dict[str, Any]:
    """Register a built variant's version from the digests its build stage stored."""
    return run_stage(request, slot, _register_body).model_dump(mode="json")


@flow(name="quantyard-reference", flow_run_name="{request.name}", log_prints=True)
def reference_stage(request: StageRequest, slot: str | None = None) -> dict[str, Any]:
    """The window set and the reference log-probs of the source (registry artifacts, computed once)."""
    return run_stage(request, slot, _reference_body).model_dump(mode="json")


@flow(name="quantyard-evaluate", flow_run_name="{request.name}", log_prints=True)
def evaluate_stage(request: StageRequest, slot: str | None = None) -> dict[str, Any]:
    """Evaluate one registered version on one engine; results go to the registry."""
    return run_stage(request, slot, _evaluate_body).model_dump(mode="json")


@flow(name="quantyard-serve", flow_run_name="{request.name}", log_prints=True)
def serve_stage(request: StageRequest, slot: str | None = None) -> dict[str, Any]:
    """Serve one registered version on its engine's server and load-test it; the result goes to the registry."""
    return run_stage(request, slot, _serve_body).model_dump(mode="json")


STAGE_FLOWS: dict[str, Any] = {"resolve": resolve_stage, "prepare": prepare_stage, "build": build_stage,
                               "register": register_stage, "reference": reference_stage,
                               "evaluate": evaluate_stage, "serve": serve_stage}


def deployment_name(stage: str, pool: str) -> str:
    """``flow name/deployment name`` of a stage on a logical pool (cpu or gpu)."""
    return f"{STAGE_FLOWS[stage].name}/{pool}"


__all__ = ["BODIES", "HEAVY_STAGES", "STAGE_FLOWS", "InProcess", "deployment_name", "run_stage", "stage_settings",
           "variant_build_key"]
