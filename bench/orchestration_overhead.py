"""Orchestration overhead on the demo: the time Prefect and the registry add to a run, as a % of its wall time.

Two modes, the same plan (the demo checkpoint, GGUF Q8_0 + Q4_K_M, the default evaluation):

* **embedded** — ``convert_flow`` in this process with Prefect's embedded server (what ``quantyard convert``
  and ``make demo`` do). The tool work (resolve/validate, F16 conversion, quantization, window set,
  reference, evaluation: the step functions the stage bodies call) is timed by wrapping each of them, and
  every call into the ``Registry`` API is timed too; time is attributed to the innermost category, so a
  registry write inside an evaluation counts as registry time. Overhead = wall − tool work, split into
  registry and Prefect-and-glue. The embedded server's start (once per process) is reported apart.
* **server** — ``quantyard orchestrate`` against a real ``prefect server start`` with one process worker
  per pool (tests/prefect_cluster.py), every stage a deployment run. Each stage records its tool work;
  overhead = 1 − (tool work on the critical path of the stage graph) / wall. Per-stage dispatch cost
  (flow-run scheduling, process start, imports) is printed too.

    python bench/orchestration_overhead.py [--mode embedded|server|both] [--types Q8_0,Q4_K_M]

Target (issue 9): under 5 % embedded.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Attribution:
    """Exclusive time per category: a wrapped call's time goes to its category minus nested wrapped calls."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # [start, nested time]

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, nested = self._stack.pop()
                elapsed = time.perf_counter() - start
                self.totals[category] += elapsed - nested
                self.calls[category] += 1
                if self._stack:
                    self._stack[-1][1] += elapsed

        return timed


def _instrument(att: Attribution) -> None:
    from flows import quantize, steps
    from registry.store import Registry

    # The stage bodies call these step functions through the module (``steps.build_variant(...)``), and the
    # embedded executor resolves the source through its resolve task once per run.
    for name in ("prepare_format", "build_variant", "ensure_window_set", "ensure_reference", "evaluate_version"):
        setattr(steps, name, att.wrap("work", getattr(steps, name)))
    quantize.resolve_task.fn = att.wrap("work", quantize.resolve_task.fn)
    for name, member in list(vars(Registry).items()):
        if isinstance(member, types.FunctionType) and not name.startswith("__"):  # methods, not static ones
            setattr(Registry, name, att.wrap("registry", member))


def _plan(demo: Path, types: str) -> Any:
    from pipeline.plan import Plan, SourceInput, variants_from_flags

    return Plan(source=SourceInput(source=str(demo)), model_name="demo", variants=variants_from_flags(gguf=types))


def embedded(demo: Path, types: str, work: Path) -> dict[str, float]:
    from pipeline.cli.common import prefect_defaults

    prefect_defaults()
    from flows.quantize import convert_flow
    from pipeline.config import Settings

    att = Attribution()
    _instrument(att)
    settings = Settings(registry=str(work / "registry"), work_dir=work / "work")  # type: ignore[arg-type]
    t0 = time.perf_counter()
    report = convert_flow(_plan(demo, types), settings)
    first = time.perf_counter() - t0
    assert report.ok and all(v.eval_status == "ok" for v in report.variants), report.events
    wall = report.wall_s
    work_s, registry_s = att.totals["work"], att.totals["registry"]
    return {"call_s": first, "wall_s": wall, "server_start_s": first - wall, "work_s": work_s,
            "registry_s": registry_s, "prefect_s": wall - work_s - registry_s, "tasks": att.calls["work"],
            "registry_calls": att.calls["registry"]}


def _critical_path(stages: list[dict[str, Any]]) -> float:
    by = {s["stage"]: s for s in stages}
    memo: dict[str, float] = {}

    def finish(name: str) -> float:
        if name not in memo:
            s = by[name]
            memo[name] = float(s.get("work_s") or 0.0) + max((finish(d) for d in s.get("deps") or []), default=0.0)
        return memo[name]

    return max(finish(n) for n in by)


def server(demo: Path, types: str, work: Path) -> dict[str, Any]:
    import yaml

    from tests.prefect_cluster import PrefectCluster

    cluster = PrefectCluster(work, extra_env={"QUANTYARD_WORK_DIR": str(work / "work")})
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "demo", "source": str(demo),
                                      "formats": {"gguf": {"types": types.split(",")}}}))
    try:
        cluster.start_server()
        cluster.cli_json("deploy")
        for pool in ("cpu", "gpu"):
            cluster.start_worker(pool)
            cluster.wait_worker(pool)
        t0 = time.perf_counter()
        (run,) = cluster.cli_json("orchestrate", str(recipe), "--registry", str(work / "registry"), timeout=3600)
        call = time.perf_counter() - t0
        t1 = time.perf_counter()
        (rerun,) = cluster.cli_json("orchestrate", str(recipe), "--registry", str(work / "registry"))
        rerun_call = time.perf_counter() - t1
    finally:
        cluster.stop_all()
    report = run["report"]
    stages = report["stages"]
    assert all(s["status"] == "ran" for s in stages), stages
    dispatch = [float(s["dispatch_s"]) - float(s["work_s"] or 0.0) for s in stages]
    return {"call_s": call, "wall_s": report["wall_s"], "work_s": sum(float(s["work_s"] or 0) for s in stages),
            "critical_work_s": _critical_path(stages), "stages": len(stages),
            "dispatch_overhead_median_s": statistics.median(dispatch), "dispatch_overhead_max_s": max(dispatch),
            "rerun_wall_s": rerun["report"]["wall_s"], "rerun_call_s": rerun_call,
            "rerun_statuses": sorted({s["status"] for s in rerun["report"]["stages"]})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("embedded", "server", "both"), default="both")
    p.add_argument("--types", default="Q8_0,Q4_K_M")
    args = p.parse_args()
    from pipeline.config import Settings
    from pipeline.demo_model import cached_demo_model

    demo = cached_demo_model(Settings().cache_dir)
    if args.mode in ("embedded", "both"):
        with tempfile.TemporaryDirectory(prefix="quantyard-overhead-") as tmp:
            e = embedded(demo, args.types, Path(tmp))
        over = e["wall_s"] - e["work_s"]
        print(f"embedded: flow wall {e['wall_s']:.2f} s, tool work {e['work_s']:.2f} s in {e['tasks']} tasks, "
              f"registry {e['registry_s']:.2f} s in {e['registry_calls']} calls, Prefect and glue "
              f"{e['prefect_s']:.2f} s")
        pct = {k: 100 * e[k] / e["wall_s"] for k in ("registry_s", "prefect_s")}
        print(f"embedded: overhead {100 * over / e['wall_s']:.2f} % of the flow's wall time (registry "
              f"{pct['registry_s']:.2f} %, Prefect and glue {pct['prefect_s']:.2f} %)"
              f"; embedded server start {e['server_start_s']:.2f} s once per process, "
              f"{100 * (e['call_s'] - e['work_s']) / e['call_s']:.2f} % counting it  (target < 5 %)")
    if args.mode in ("server", "both"):
        with tempfile.TemporaryDirectory(prefix="quantyard-overhead-") as tmp:
            s = server(demo, args.types, Path(tmp))
        print(f"server:   orchestration wall {s['wall_s']:.2f} s ({s['stages']} stages as deployment runs), tool "
              f"work {s['work_s']:.2f} s, on the critical path {s['critical_work_s']:.2f} s")
        print(f"server:   overhead {100 * (1 - s['critical_work_s'] / s['wall_s']):.1f} % of the wall time; "
              f"per-stage dispatch overhead median {s['dispatch_overhead_median_s']:.2f} s, "
              f"max {s['dispatch_overhead_max_s']:.2f} s")
        print(f"server:   rerun {s['rerun_wall_s']:.2f} s in the flow ({s['rerun_call_s']:.2f} s for the CLI call), "
              f"stage statuses {s['rerun_statuses']}")


if __name__ == "__main__":
    main()
