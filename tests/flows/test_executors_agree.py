"""The two executors of the one stage graph (flows/graph.py) — embedded (``convert_flow``: every stage in
this process) and distributed (``orchestrate_flow``: every stage as a stage flow, dispatched here in-process
instead of to work pools) — run one recipe into two empty registries, which must then hold the same thing:
the same stages under the same ledger keys, the same variants and version numbers, build keys, files
(sha256), lineage options and tool, and the same results on the same window set. Each executor then reuses
the other's registry without running a stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.plan import CalibrationSpec, EvalSpec, GGUFOptions, Plan, SourceInput, SpeedSpec, variants_from_flags
from registry import open_registry
from tests.conftest import make_settings

pytestmark = pytest.mark.slow


def _plan(demo_model: Path) -> Plan:
    # one imatrix quant: the base and the imatrix are shared prepared files (blobs when distributed)
    variants = variants_from_flags(gguf="Q4_K_M", imatrix=True)
    return Plan(source=SourceInput(source=str(demo_model)), model_name="demo", variants=variants,
                eval=EvalSpec(max_windows=2, speed=SpeedSpec(enabled=False)),
                gguf=GGUFOptions(calibration=CalibrationSpec(chunks=4)))


def _snapshot(registry: Path) -> dict[str, Any]:
    reg = open_registry(str(registry))
    out: dict[str, Any] = {}
    for variant in reg.list_variants("demo"):
        for number in [v.number for v in reg.list_versions("demo", variant.name)]:
            view = reg.get_version(f"demo/{variant.name}@{number}")
            results = sorted((r.kind, r.engine, r.window_set_id, r.status,
                              round(r.metrics.get("kld_mean", 0.0), 9), round(r.metrics.get("ppl", 0.0), 6))
                             for r in view.results)
            out[view.ref] = {"format": view.format, "spec": view.spec, "build_key": view.build_key,
                             "files": sorted((f.name, f.sha256) for f in view.files),
                             "options": view.lineage.get("options"), "tool": view.lineage.get("tool"),
                             "results": results}
    return out


def _ledger(registry: Path, identity: str) -> dict[str, str]:
    return {a.meta["stage"]: a.key for a in open_registry(str(registry)).list_source_artifacts(identity, "stage")}


def test_embedded_and_distributed_runs_give_the_same_registry(
        demo_model: Path, cache_dir: Path, tmp_path: Path, prefect_harness: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.orchestrate import orchestrate_flow
    from flows.quantize import convert_flow

    plan = _plan(demo_model)
    embedded = make_settings(tmp_path / "embedded", tmp_path / "work-embedded", cache_dir)
    report = convert_flow(plan, embedded)
    assert report.ok, report
    assert {s["status"] for s in report.stages} == {"ran"}, report.stages

    # the orchestrator and its stages build their Settings from the environment, as on a worker
    monkeypatch.setenv("QUANTYARD_WORK_DIR", str(tmp_path / "work-distributed"))
    monkeypatch.setenv("QUANTYARD_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("QUANTYARD_THREADS", "2")
    distributed = tmp_path / "distributed"
    staged = orchestrate_flow(plan, registry=str(distributed), dispatch="local")
    assert {s["status"] for s in staged.stages} == {"ran"}, staged.stages

    one, two = _snapshot(tmp_path / "embedded"), _snapshot(distributed)
    assert sorted(one) == ["demo/i1-Q4_K_M@1"]
    assert one == two
    identity = report.source["identity"]
    assert staged.source["identity"] == identity
    stages = _ledger(tmp_path / "embedded", identity)
    assert sorted(stages) == ["build:i1-Q4_K_M", "evaluate:i1-Q4_K_M:llama.cpp", "prepare:gguf", "reference",
                              "register:i1-Q4_K_M", "resolve"]
    assert stages == _ledger(distributed, identity)
    assert report.events == staged.events
    assert [v.quality["kld_mean"] for v in report.variants] == [v.quality["kld_mean"] for v in staged.variants]

    # each executor finds the other's work: nothing is built again
    again = convert_flow(plan, make_settings(distributed, tmp_path / "work-distributed", cache_dir))
    assert {s["status"] for s in again.stages} == {"reused"}, again.stages
    assert {v.status for v in again.variants} == {"reused"} and _snapshot(distributed) == two
    back = orchestrate_flow(plan, registry=str(tmp_path / "embedded"), dispatch="local")
    assert {s["status"] for s in back.stages} == {"reused"}, back.stages
    assert {v.status for v in back.variants} == {"reused"} and _snapshot(tmp_path / "embedded") == one
