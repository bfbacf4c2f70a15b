"""Distributed runs on a real Prefect server with real process workers (issue 9).

One module-scoped cluster: ``prefect server start`` on loopback with its own PREFECT_HOME, two process
work pools ("cpu", "gpu"), one ``prefect worker start`` per pool, ``quantyard deploy``. The tests then
drive ``quantyard orchestrate`` (a subprocess, like a user) and read the Prefect API to see where every
stage ran. Everything is stopped by PID at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.prefect_cluster import PrefectCluster, descendants

pytestmark = pytest.mark.slow

#: Every stage placed on a pool: conversion on cpu (the default for GGUF), the reference and the
#: llama.cpp evaluation on gpu (told so by the recipe), so both pools get work on a CPU-only machine.
PLACEMENT = {"reference": "gpu", "engines": {"llama.cpp": "gpu"}}


def write_recipe(path: Path, source: Path, types: list[str], name: str = "demo", evaluate: bool = True) -> Path:
    recipe = {"name": name, "source": str(source), "formats": {"gguf": {"types": types}},
              "eval": {"max_windows": 4, "speed": False} if evaluate else {"enabled": False}, "placement": PLACEMENT}
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[PrefectCluster]:
    root = tmp_path_factory.mktemp("cluster")
    c = PrefectCluster(root, extra_env={"QUANTYARD_WORK_DIR": str(root / "work")})
    try:
        c.start_server()
        deployed = c.cli_json("deploy", "--work-pool-cpu", "cpu", "--work-pool-gpu", "gpu", "--gpu-concurrency", "1")
        assert any("created work pool cpu" in line for line in deployed["changes"])
        for pool in ("cpu", "gpu"):
            c.start_worker(pool)
        for pool in ("cpu", "gpu"):
            c.wait_worker(pool)
        yield c
    finally:
        c.stop_all()
        assert not any(p.poll() is None for p in c.procs.values())


def stage_runs(c: PrefectCluster) -> list[dict[str, Any]]:
    """Flow runs of stage deployments (not the orchestrator, which runs in the CLI process)."""
    deployments = {d["id"]: d for d in c.api("POST", "/deployments/filter", {"limit": 200})}
    runs = []
    for run in c.flow_runs():
        dep = deployments.get(run.get("deployment_id"))
        if dep is not None:
            runs.append({**run, "deployment": dep["name"], "flow_id": dep["flow_id"]})
    return runs


def orchestrate(c: PrefectCluster, recipe: Path, registry: Path) -> dict[str, Any]:
    (run,) = c.cli_json("orchestrate", str(recipe), "--registry", str(registry), timeout=1200)
    return run["report"]


def test_deploy_registers_every_stage_on_both_pools(cluster: PrefectCluster) -> None:
    names = {(d["name"], d["work_pool_name"]) for d in cluster.api("POST", "/deployments/filter", {"limit": 200})}
    assert {("cpu", "cpu"), ("gpu", "gpu"), ("default", "cpu")} <= names
    limits = {lim["name"]: lim["limit"] for lim in cluster.api("POST", "/v2/concurrency_limits/filter", {})}
    assert limits.get("quantyard-gpu") == 1 and "quantyard-cpu" not in limits


def test_orchestration_runs_stages_on_their_pools_and_a_rerun_does_no_work(
        cluster: PrefectCluster, demo_model: Path, tmp_path: Path) -> None:
    registry = tmp_path / "shared-registry"
    recipe = write_recipe(tmp_path / "recipe.yaml", demo_model, ["Q8_0", "Q4_K_M"])
    report = orchestrate(cluster, recipe, registry)
    stages = {s["stage"]: s for s in report["stages"]}
    assert {s["status"] for s in stages.values()} == {"ran"}, stages
    expected = {"resolve": "cpu", "prepare:gguf": "cpu", "build:Q8_0": "cpu", "build:Q4_K_M": "cpu",
                "register:Q8_0": "cpu", "register:Q4_K_M": "cpu", "reference": "gpu",
                "evaluate:Q8_0:llama.cpp": "gpu", "evaluate:Q4_K_M:llama.cpp": "gpu"}
    assert {name: s["pool"] for name, s in stages.items()} == expected
    # Where each stage really ran, from the Prefect API: its flow run, on the work pool of its placement.
    runs = {r["id"]: r for r in stage_runs(cluster)}
    for name, pool in expected.items():
        run = runs[stages[name]["flow_run_id"]]
        assert run["work_pool_name"] == pool and run["deployment"] == pool, (name, run["work_pool_name"])
        assert run["state_type"] == "COMPLETED" and run["name"] == name
    variants = {v["variant"]: v for v in report["variants"]}
    assert variants["Q8_0"]["quality"]["kld_mean"] < variants["Q4_K_M"]["quality"]["kld_mean"]

    from registry import open_registry

    reg = open_registry(str(registry))
    assert {v.name for v in reg.list_variants("demo")} == {"Q8_0", "Q4_K_M"}
    ledger = {a.key: a.meta for a in reg.list_source_artifacts(report["source"]["identity"], "stage")}
    assert {k: m["stage"] for k, m in ledger.items()} == {s["key"]: name for name, s in stages.items()}
    # The heavy stages on the gpu pool held a slot of its concurrency limit (1); the cpu pool has none.
    slots = {m["stage"]: m["slot"] for m in ledger.values()}
    assert slots["reference"] == slots["evaluate:Q8_0:llama.cpp"] == "quantyard-gpu"
    assert slots["build:Q8_0"] is None and slots["register:Q8_0"] is None

    # The rerun: every stage is found in the ledger under the same key; no flow run is started.
    before = len(stage_runs(cluster))
    again = orchestrate(cluster, recipe, registry)
    assert {s["stage"]: (s["status"], s["key"]) for s in again["stages"]} == \
        {name: ("reused", s["key"]) for name, s in stages.items()}
    assert again["events"] == ["reuse:Q8_0", "reuse:Q4_K_M"]
    assert len(stage_runs(cluster)) == before
    assert [v.number for v in reg.list_versions("demo", "Q8_0")] == [1]


def _variants(reg: Any) -> set[str]:
    from pipeline.errors import NotFoundError

    try:
        return {v.name for v in reg.list_variants("demo")}
    except NotFoundError:
        return set()


def _wait_for_quantizer(cluster: PrefectCluster, worker_pid: int, timeout: float = 600) -> int:
    """PID of the llama.cpp quantization worker below the CPU worker, once it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(worker_pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "converters.gguf.workers.quantize" in cmd:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no quantization started within {timeout} s:\n{cluster.log('worker-cpu')[-3000:]}")


def test_killed_worker_mid_quantization_resumes_at_the_unfinished_stage(
        cluster: PrefectCluster, demo_model: Path, tmp_path: Path) -> None:
    registry = tmp_path / "shared-registry"
    recipe = write_recipe(tmp_path / "recipe.yaml", demo_model, ["Q6_K"], evaluate=False)
    orch = cluster.cli_popen("orchestrate-crash", "orchestrate", str(recipe), "--registry", str(registry), "--json")
    worker = cluster.procs["worker-cpu"]
    _wait_for_quantizer(cluster, worker.pid)
    # The machine running the CPU worker dies mid-quantization: the worker, its flow run and the quantizer.
    cluster.stop("worker-cpu")
    # The orchestrator would wait for a flow run nobody runs any more: it dies too (the whole run crashed).
    cluster.stop("orchestrate-crash")
    assert orch.returncode is not None

    from registry import open_registry

    reg = open_registry(str(registry))
    assert _variants(reg) == set(), "a killed build registered nothing"

    cluster.start_worker("cpu")
    cluster.wait_worker("cpu")
    report = orchestrate(cluster, recipe, registry)
    status = {s["stage"]: s["status"] for s in report["stages"]}
    assert status["resolve"] == "reused" and status["prepare:gguf"] == "reused"
    assert status["build:Q6_K"] == "ran" and status["register:Q6_K"] == "ran"
    assert "quantize:Q6_K" in report["events"] and not [e for e in report["events"] if e.startswith("convert_base")]
    assert _variants(reg) == {"Q6_K"} and report["variants"][0]["status"] == "registered"
    # The killed build's flow run is left RUNNING on the server (Prefect does not know its process died):
    # the rerun ran the stage again as a new flow run under the same key.
    builds = [r for r in stage_runs(cluster) if r["name"] == "build:Q6_K"]
    assert len(builds) == 2 and sum(r["state_type"] == "COMPLETED" for r in builds) == 1


def test_watch_deployment_has_a_schedule(cluster: PrefectCluster, demo_model: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "nightly.yaml", demo_model, ["Q8_0"])
    out = cluster.cli_json("watch", str(recipe), "--interval", "600", "--registry", str(tmp_path / "reg"))
    assert out["deployment"] == "quantyard-watch/nightly"
    (dep,) = [d for d in cluster.api("POST", "/deployments/filter", {"limit": 200}) if d["name"] == "nightly"]
    assert dep["work_pool_name"] == "cpu"
    (schedule,) = dep["schedules"]
    assert schedule["schedule"]["interval"] == 600 and schedule["active"]
    assert json.loads(json.dumps(dep["parameters"]["recipe"]))["formats"] == {"gguf": {"types": ["Q8_0"]}}
