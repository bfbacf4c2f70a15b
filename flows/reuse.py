"""A re-run decided from the stage ledger alone, before Prefect starts.

``quantyard convert`` and ``make demo`` run the embedded executor (flows/quantize.py), a Prefect flow. A
re-run of a finished plan does no work there (every stage is reused from the stage ledger), yet importing
Prefect, starting its embedded server and resolving the source (loading the checkpoint, every format's
checks) took about 25 s of its 31. :func:`convert` therefore first goes through the graph the way the flow
does (:func:`flows.graph.decide`: the same order, the same ledger, the same rule for feeder stages), with the
source pinned the cheap way (:func:`flows.ledger.pin_source`: a folder's content hash is cached; a hub
revision is one API call, or the cached mapping offline). The checks and the download are not needed: the
resolve stage's record says they passed for exactly this source.

When every stage is reused (or, for a feeder, not needed) the report is the one the flow's re-run returns,
built by the same :func:`flows.graph.report`, with ``ledger_only`` set: no Prefect import, no flow run, no
table artifacts, nothing written. Otherwise, and always with ``force``, the flow runs as before.

This module imports no Prefect; :func:`convert` imports the flow only when a stage has to run, and starts
Prefect's embedded server in a child process first (flows/embedded.py), so that it starts while the source is
resolved here.
"""

from __future__ import annotations

import time

from flows import embedded, steps
from flows.graph import StageOutcome, build_graph, decide, report
from flows.ledger import pin_source
from flows.preflight import settle_reference, source_facts
from pipeline.config import Settings
from pipeline.errors import QuantyardError
from pipeline.plan import Plan
from pipeline.progress import stage
from pipeline.recipe import Placement
from pipeline.results import ConvertReport
from pipeline.specs import SourceKind, SourceRef
from registry import open_registry

#: What every stage of a run decided from the ledger alone ends as.
SETTLED = frozenset({"reused", "not_needed"})


def settled_report(plan: Plan, settings: Settings) -> ConvertReport | None:
    """The report of ``plan`` when the ledger holds every stage of it with its outputs still in the registry
    (see the module docstring); ``None`` when some stage has to run, with ``plan.force``, and when deciding
    fails with a Quantyard error (a bad registry location, a missing source: the flow then says it in its
    own words). Writes nothing."""
    if plan.force:
        return None
    t0 = time.perf_counter()
    try:
        reg = open_registry(settings)
        plan = steps.resolve_backends(plan, settings)
        identity, pinned, source = pin_source(plan.source, settings)
        plan = plan.model_copy(update={"source": pinned})
        if plan.eval.enabled and not plan.eval.settled:  # the reference is chosen as the run's pre-flight chooses
            facts = source_facts(source, settings)
            if facts is None:
                return None
            plan = settle_reference(plan, facts, settings)
        graph = build_graph(plan, identity, Placement(), {"registry": settings.registry, "blobs": settings.blobs})
        outcomes: dict[str, StageOutcome] = {}
        for name in graph.nodes:
            settled, _ = decide(reg, graph, name, outcomes)
            if settled is None or settled.status not in SETTLED:
                return None
            outcomes[name] = settled
        out = report(plan, _as_resolved(source, outcomes["resolve"]), graph, outcomes, reg)
    except QuantyardError:
        return None
    out.wall_s, out.ledger_only = time.perf_counter() - t0, True
    return out


def _as_resolved(pinned: SourceRef, resolve: StageOutcome) -> SourceRef:
    """The source as the flow's resolve gives it: a folder where it is now; a hub snapshot where the
    resolve stage downloaded it (this run downloads nothing)."""
    recorded: SourceRef = resolve.outputs().source
    return recorded if pinned.kind == SourceKind.HUB and recorded.identity == pinned.identity else pinned


def convert(plan: Plan, settings: Settings) -> ConvertReport:
    """Run ``plan`` with the embedded executor (``flows.quantize.convert_flow``), unless the stage ledger
    already holds every stage of it: then its report without starting Prefect (:func:`settled_report`).
    When it runs, Prefect's embedded server starts in a child process while the source is resolved here
    (:func:`flows.steps.preresolve`); the flow takes that resolution instead of resolving again, and a
    source that fails its checks stops the run before the flow starts. Raises what the flow raises."""
    settled = settled_report(plan, settings)
    if settled is not None:
        return settled
    t0 = time.perf_counter()
    server = embedded.start(settings.logs_root)
    try:
        with stage("resolve", plan.source.source):  # a source that fails its checks stops here, before the flow
            steps.preresolve(steps.resolve_backends(plan, settings), settings)
        if server is not None:
            server.decision()  # before Prefect is imported: PREFECT_API_URL must name the server by then
        from flows.console import quiet_typed_failures
        from flows.quantize import convert_flow  # Prefect is imported, and its server started, only for work

        quiet_typed_failures()  # a typed failure's traceback stays out of the terminal (flows/console.py)
        if server is not None:
            server.ready()  # the flow must not call a server that is still starting
        with embedded.without_heartbeats(server):
            out = convert_flow(plan, settings)
    finally:
        steps.forget_preresolved()
    out.wall_s = time.perf_counter() - t0  # the run's: resolving the source and waiting for the server too
    return out


__all__ = ["SETTLED", "convert", "settled_report"]
