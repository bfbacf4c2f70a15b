"""The distributed executor: the stage graph of flows/graph.py, every stage a Prefect deployment run on
the work pool its placement names, in parallel where stages are independent.

Before dispatching a stage the orchestrator settles it against the stage ledger (``graph.settle``): a stage
already recorded, whose outputs are still in the registry, is reused without a flow run. A rerun of a
finished run therefore dispatches nothing, and a rerun after a crash starts at the first stage that did
not finish; a run of the embedded executor (flows/quantize.py) is reused the same way. ``dispatch="local"``
runs the same stage flows in this process (tests, one machine).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from flows.graph import Graph, StageOutcome, StageRequest, StageStatus, build_graph, publish, report, settle
from flows.ledger import find_stage, pin_source
from flows.preflight import settle_reference, source_facts
from flows.stages import STAGE_FLOWS, deployment_name, stage_settings
from pipeline.config import Settings
from pipeline.errors import ConfigError, InvalidSpecError, QuantyardError
from pipeline.plan import Plan
from pipeline.recipe import Placement
from pipeline.results import ConvertReport
from registry import open_registry

Dispatch = Literal["deployments", "local"]


def _dispatch(request: StageRequest, dispatch: Dispatch, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    """Run one stage; returns (finished, facts about the run: flow run id, work pool, state message)."""
    if dispatch == "local":
        try:
            STAGE_FLOWS[request.stage](request=request)
        except QuantyardError as exc:
            return False, {"error": exc.summary(), "error_type": type(exc).__name__}
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
    facts: dict[str, Any] = {"flow_run_id": str(run.id), "work_pool": run.work_pool_name}
    if run.state is None or not run.state.is_completed():
        facts["error"] = f"flow run {run.name} ended {run.state_name}: {run.state.message if run.state else ''}"
        return False, facts
    return True, facts


@task(name="stage", task_run_name="{request.name}", cache_policy=NONE)
def stage_task(request: StageRequest, upstream: list[StageOutcome], dispatch: Dispatch,
               timeout_s: float) -> StageOutcome:
    """Reuse the stage's ledger record, or dispatch it once every upstream stage finished."""
    logger = get_run_logger()
    reg = open_registry(stage_settings(request))
    settled, request = settle(reg, request, upstream)
    if settled is not None:
        logger.info("stage %-34s %-4s %s%s", request.name, request.pool, settled.status,
                    f": {settled.error}" if settled.error else f"  key {request.key[:16]}")
        return settled
    t0 = time.perf_counter()
    ok, facts = _dispatch(request, dispatch, timeout_s)
    record = find_stage(reg, request.source_identity, request.key) if ok else None
    if ok and record is None:
        ok, facts["error"] = False, "the stage finished without recording its output in the ledger"
    status: StageStatus = "ran" if ok else "failed"
    logger.info("stage %-34s %-4s %-7s key %s in %.1f s%s", request.name, request.pool, status, request.key[:16],
                time.perf_counter() - t0, f": {facts.get('error')}" if not ok else "")
    return request.outcome(status, record=record, dispatch_s=time.perf_counter() - t0, **facts)


# --- the flow ------------------------------------------------------------------------------------


@flow(name="quantyard-orchestrate", log_prints=True)
def orchestrate_flow(plan: Plan, registry: str | None = None, blobs: str | None = None,
                     placement: Placement | None = None, dispatch: Dispatch = "deployments",
                     timeout_s: float | None = None) -> ConvertReport:
    """Run ``plan`` as stages on the work pools (see the module docstring); returns the same report as the
    embedded executor, with one entry per stage in ``report.stages``."""
    t0 = time.perf_counter()
    settings = Settings(**{k: v for k, v in (("registry", registry), ("blobs", blobs)) if v})  # type: ignore[arg-type]
    reg = open_registry(settings)  # a bad registry location fails before any work is dispatched
    identity, pinned, source = pin_source(plan.source, settings)
    pinned_plan = plan.model_copy(update={"source": pinned})
    if plan.eval.enabled and not plan.eval.settled:
        # chosen here, from the source's shape and this machine's memory (the machine that orchestrates: say
        # --reference-engine where the reference's work pool is another kind of machine)
        facts = source_facts(source, settings, download=True)
        if facts is None:
            raise InvalidSpecError(f"cannot read the shape of {plan.source.source} to choose its reference engine",
                                   hint="name it: --reference-engine transformers | llama.cpp | vllm")
        pinned_plan = settle_reference(pinned_plan, facts, settings)
    graph: Graph = build_graph(pinned_plan, identity, placement or Placement(),
                               {"registry": settings.registry, "blobs": settings.blobs},
                               nonce=uuid.uuid4().hex if plan.force else None)
    futures: dict[str, Any] = {}
    for name, node in graph.nodes.items():
        futures[name] = stage_task.submit(node.request, [futures[d] for d in node.deps], dispatch,
                                          timeout_s or settings.convert_timeout_s)
    outcomes = {name: f.result() for name, f in futures.items()}
    out = report(plan, source, graph, outcomes, reg)
    out.wall_s = time.perf_counter() - t0
    publish(out)
    return out
