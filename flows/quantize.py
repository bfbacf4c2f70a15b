"""The embedded executor (``quantyard convert``, ``make demo``): the stage graph of flows/graph.py, every
stage run in this process, in the graph's order, through the same stage bodies and the same stage ledger as
the distributed executor (flows/orchestrate.py). Stages run one after the other, except a run of llama.cpp
evaluations without speed measurement: those run at once, the threads split between them, as far as
memory allows (flows/schedule.py says why and when; the report records the schedule).

Re-running is cheap by construction: a stage whose key is in the ledger is reused without running (a
variant whose build key is already registered is reused by its build stage even without a ledger record),
the GGUF base is cached per source, and window sets and reference log-probs are registry artifacts of the
source. A preparation or the reference runs only when a stage that reads it must run. A source that fails
its checks or its preparation stops the run with that error and leaves the registry as it was; one variant
failing (conversion or engine) is recorded and the others go on; a full disk stops the run with its error.
A re-run whose every stage is recorded does not reach this flow: flows/reuse.py decides it before Prefect
starts.
"""

from __future__ import annotations

import contextvars
import queue
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import psutil  # type: ignore[import-untyped]
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from evaluators.engines import engine_info
from flows import steps
from flows.graph import Graph, StageOutcome, StageRequest, build_graph, decide, publish, report
from flows.ledger import StageRecord, pinned_input
from flows.preflight import add_preflight, disk_free_by_filesystem, disk_used
from flows.schedule import EvalSchedule, plan_evaluations
from flows.stages import BODIES, InProcess, progress_to_log, run_stage
from pipeline import workdir
from pipeline.config import Settings
from pipeline.errors import DiskFullError, QuantyardError
from pipeline.plan import Plan
from pipeline.progress import stage
from pipeline.recipe import Placement
from pipeline.results import ConvertReport
from registry import open_registry
from registry.store import Registry

# task(**options)(fn) is what task(fn, **options) does at run time; only this form is in Prefect's typed
# overloads, so the Task keeps the step's parameter and return types.
resolve_task = task(name="resolve-source", cache_policy=NONE)(steps.resolve)


@task(name="stage", task_run_name="{request.name}", cache_policy=NONE)
def stage_here(request: StageRequest, here: InProcess) -> StageRecord:
    """One stage of the graph, in this process; where its tools are goes to its Prefect log (progress_to_log)."""
    with progress_to_log(get_run_logger(), request.stage, request.variant or request.fmt or ""):
        return run_stage(request, None, BODIES[request.stage], here)


def _run(reg: Registry, graph: Graph, name: str, outcomes: dict[str, StageOutcome], here: InProcess,
         prepare_failures: list[QuantyardError] | None = None) -> StageOutcome:
    settled, request = decide(reg, graph, name, outcomes)
    if settled is not None:
        return settled
    return _execute(request, here, prepare_failures)


def _execute(request: StageRequest, here: InProcess,
             prepare_failures: list[QuantyardError] | None = None) -> StageOutcome:
    """Run one decided stage here: its outcome (``failed`` with the error for a stage whose failure does not
    stop the run). A format's failed preparation stops the run only where ``prepare_failures`` is None (the
    plan has one format); else it is kept there, and that format's stages are skipped, as the distributed
    executor does (:func:`_convert` raises it when every format's preparation failed)."""
    t0 = time.perf_counter()
    try:
        with stage(request.stage, request.variant or request.fmt or ""):
            record = stage_here(request, here)
    except DiskFullError:
        raise  # no later stage can succeed either: stop with the clear error
    except QuantyardError as exc:
        if request.stage == "resolve" or (request.stage == "prepare" and prepare_failures is None):
            raise  # the source or the plan's one format's preparation failed: nothing of this run can be built
        if prepare_failures is not None and request.stage == "prepare":
            prepare_failures.append(exc)
        return request.outcome("failed", error=exc.summary(), error_type=type(exc).__name__,
                               dispatch_s=time.perf_counter() - t0, start_s=t0 - here.started)
    return request.outcome("ran", record=record, dispatch_s=time.perf_counter() - t0, start_s=t0 - here.started)


def _shares_cpu(request: StageRequest) -> bool:
    return request.stage == "evaluate" and request.engine is not None and engine_info(request.engine).cpu_shared


def _run_together(reg: Registry, graph: Graph, names: list[str], outcomes: dict[str, StageOutcome],
                  here: InProcess) -> EvalSchedule | None:
    """Consecutive evaluations on an engine that shares the CPU: decide each, then run those to run as
    :func:`~flows.schedule.plan_evaluations` says (several at once, each with its share of the threads).
    Returns the schedule, None when nothing had to run."""
    todo: list[StageRequest] = []
    for name in names:
        settled, request = decide(reg, graph, name, outcomes)
        if settled is not None:
            outcomes[name] = settled
        else:
            todo.append(request)
    if not todo:
        return None
    sizes = [reg.get_version(outcomes[graph.nodes[r.name].deps[0]].outputs().ref).size for r in todo]
    plan = todo[0].plan
    schedule = plan_evaluations(sizes, threads=here.settings.threads, jobs=here.settings.eval_jobs,
                                speed=plan.eval.speed.enabled, mem_available=psutil.virtual_memory().available,
                                engine=str(todo[0].engine))
    if schedule.at_once == 1:
        for request in todo:
            outcomes[request.name] = _execute(request, here)
        return schedule
    here.flush(reg)  # nothing is pending after the builds; written here, never from two threads at once
    slots: queue.Queue[int] = queue.Queue()
    for threads in schedule.threads:
        slots.put(threads)

    def one(request: StageRequest) -> StageOutcome:
        threads = slots.get()
        try:
            return _execute(request, replace(here, settings=here.settings.model_copy(update={"threads": threads})))
        finally:
            slots.put(threads)

    with ThreadPoolExecutor(max_workers=schedule.at_once, thread_name_prefix="quantyard-eval") as pool:
        # each in a copy of this context: the stage task runs inside this flow run, as Prefect's own
        # thread-pool task runner does it
        futures = [(r.name, pool.submit(contextvars.copy_context().run, one, r)) for r in todo]
        errors: list[BaseException] = []
        for name, future in futures:
            try:
                outcomes[name] = future.result()
            except BaseException as exc:  # re-raised below, once every evaluation has ended
                errors.append(exc)
    if errors:
        raise errors[0]
    return schedule


@flow(name="quantyard-convert", log_prints=True)
def convert_flow(plan: Plan, settings: Settings) -> ConvertReport:
    """Convert one source into every variant of ``plan``, register and evaluate them (module docstring).
    The run holds the work folder's lease throughout (``quantyard work prune`` is refused until it ends)."""
    with workdir.lease(settings.work_root):
        return _convert(plan, settings)


def _convert(plan: Plan, settings: Settings) -> ConvertReport:
    t0 = time.perf_counter()
    reg = open_registry(settings)  # a bad registry location fails before any work is done
    free_before = disk_free_by_filesystem(settings)
    steps.sweep_stale(settings)
    plan = steps.resolve_backends(plan, settings)
    # resolved and validated once, with every format's checks, before any stage runs (fail fast); from the
    # plan as given, so that the lineage keeps the revision asked for (main) next to its commit. The CLI's
    # run resolved it already, while this flow's server started (flows/reuse.py): then that is used.
    early = steps.take_preresolved(plan, settings)
    if early is not None:
        here = InProcess(settings=settings, resolved=early)
    else:
        with stage("resolve", plan.source.source):
            here = InProcess(settings=settings, resolved=resolve_task(plan, settings))
    source = here.resolved.source
    asked = plan
    if here.resolved.preflight is not None:  # the reference chosen, refused formats left out (flows/preflight.py)
        plan = here.resolved.preflight.plan
    plan = plan.model_copy(update={"source": pinned_input(plan.source, source)})
    graph = build_graph(plan, source.identity, Placement(), {"registry": settings.registry, "blobs": settings.blobs},
                        nonce=uuid.uuid4().hex if plan.force else None)
    outcomes: dict[str, StageOutcome] = {}
    schedule: EvalSchedule | None = None
    names = list(graph.nodes)
    prepares = [n for n in names if graph.nodes[n].request.stage == "prepare"]
    # with several formats, one whose preparation fails (llama.cpp refusing the tokenizer) does not stop the others
    prepare_failures: list[QuantyardError] | None = [] if len(prepares) > 1 else None
    i = 0
    while i < len(names):
        j = i
        while j < len(names) and _shares_cpu(graph.nodes[names[j]].request):
            j += 1
        if j - i > 1:
            schedule = _run_together(reg, graph, names[i:j], outcomes, here) or schedule
            i = j
        else:
            outcomes[names[i]] = _run(reg, graph, names[i], outcomes, here, prepare_failures)
            i += 1
    if prepare_failures and all(outcomes[n].status == "failed" for n in prepares):
        raise prepare_failures[0]  # nothing of this run could be built: the first format's error, as for one
    out = report(plan, source, graph, outcomes, reg)
    add_preflight(out, asked, here.resolved.preflight)
    out.disk_used = disk_used(free_before, settings)
    out.eval_schedule = schedule.as_dict() if schedule is not None else None
    out.wall_s = time.perf_counter() - t0
    publish(out)
    return out
