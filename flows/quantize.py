"""The embedded executor (``quantyard convert``, ``make demo``): the stage graph of flows/graph.py, every
stage run in this process, one after the other, through the same stage bodies and the same stage ledger as
the distributed executor (flows/orchestrate.py).

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

import time
import uuid

from prefect import flow, task
from prefect.cache_policies import NONE

from flows import steps
from flows.graph import Graph, StageOutcome, StageRequest, build_graph, decide, publish, report
from flows.ledger import StageRecord, pinned_input
from flows.stages import BODIES, SOURCE_STAGES, InProcess, run_stage
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
    """One stage of the graph, in this process."""
    return run_stage(request, None, BODIES[request.stage], here)


def _run(reg: Registry, graph: Graph, name: str, outcomes: dict[str, StageOutcome], here: InProcess) -> StageOutcome:
    settled, request = decide(reg, graph, name, outcomes)
    if settled is not None:
        return settled
    t0 = time.perf_counter()
    try:
        with stage(request.stage, request.variant or request.fmt or ""):
            record = stage_here(request, here)
    except DiskFullError:
        raise  # no later stage can succeed either: stop with the clear error
    except QuantyardError as exc:
        if request.stage in SOURCE_STAGES:
            raise  # the source or a format's preparation of it failed: nothing of this run can be built
        return request.outcome("failed", error=exc.summary(), error_type=type(exc).__name__,
                               dispatch_s=time.perf_counter() - t0)
    return request.outcome("ran", record=record, dispatch_s=time.perf_counter() - t0)


@flow(name="quantyard-convert", log_prints=True)
def convert_flow(plan: Plan, settings: Settings) -> ConvertReport:
    """Convert one source into every variant of ``plan``, register and evaluate them (module docstring)."""
    t0 = time.perf_counter()
    reg = open_registry(settings)  # a bad registry location fails before any work is done
    steps.sweep_stale(settings)
    plan = steps.resolve_backends(plan, settings)
    with stage("resolve", plan.source.source):
        # resolved and validated once, with every format's checks, before any stage runs (fail fast); from
        # the plan as given, so that the lineage keeps the revision asked for (main) next to its commit
        here = InProcess(settings=settings, resolved=resolve_task(plan, settings))
        source = here.resolved.source
        plan = plan.model_copy(update={"source": pinned_input(plan.source, source)})
    graph = build_graph(plan, source.identity, Placement(), {"registry": settings.registry, "blobs": settings.blobs},
                        nonce=uuid.uuid4().hex if plan.force else None)
    outcomes: dict[str, StageOutcome] = {}
    for name in graph.nodes:
        outcomes[name] = _run(reg, graph, name, outcomes, here)
    out = report(plan, source, graph, outcomes, reg)
    out.wall_s = time.perf_counter() - t0
    publish(out)
    return out
