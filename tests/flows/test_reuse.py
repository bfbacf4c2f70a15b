"""A re-run of a finished plan (flows/reuse.py): decided from the stage ledger before Prefect starts, with the
report the flow's own re-run gives. A real convert of the demo checkpoint into a real registry, Prefect's test
server; what did not happen is read from real records: this process's audit events (every subprocess, fork
and exec it starts), the stages' progress events, Prefect's flow runs, the registry's contents, and the
modules a CLI re-run imports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from typer.testing import CliRunner

from flows.reuse import convert, settled_report
from pipeline.cli import app
from pipeline.cli.convert import EvalFlags, GGUFFlags, SourceFlags, VariantFlags, plan_from_options
from pipeline.config import Settings
from pipeline.plan import Plan
from pipeline.progress import RESOLVE_PARTS, Event, listening
from pipeline.results import ConvertReport
from tests.conftest import make_settings, procs_with_env, registry_snapshot

#: The small convert, as CLI flags (the CLI test) and as the plan they make (the others).
FLAGS = ("--gguf", "Q8_0", "--max-windows", "4", "--no-speed", "--threads", "2")
#: The audit events of starting a process (an engine runner, a converter worker, a tool, a server).
SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork", "os.forkpty", "os.spawn", "os.system"}
)
_recorders: list[list[str]] = []  # an audit hook cannot be removed: it records only while a block is open


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in SPAWN_EVENTS:
        for spawned in _recorders:
            spawned.append(f"{event} {args[:2]!r}")  # what was started, with its arguments


sys.addaudithook(_audit)


@contextmanager
def spawns() -> Iterator[list[str]]:
    """Every process this process starts inside the block, from its audit events."""
    spawned: list[str] = []
    _recorders.append(spawned)
    try:
        yield spawned
    finally:
        _recorders.remove(spawned)


def _plan(demo: Path, gguf: str = "Q8_0") -> Plan:
    return plan_from_options(
        SourceFlags(source=str(demo)), VariantFlags(gguf=gguf), GGUFFlags(), EvalFlags(max_windows=4, no_speed=True)
    )


def _flow_runs() -> int:
    from prefect.client.orchestration import get_client

    async def count() -> int:
        async with get_client() as client:
            return await client.count_flow_runs()

    return asyncio.run(count())


class First(NamedTuple):
    settings: Settings
    report: ConvertReport
    spawned: list[str]  # what the first run started: the observables below do see work
    progress: list[Event]


@pytest.fixture(scope="module")
def finished(
    tmp_path_factory: pytest.TempPathFactory, demo_model: Path, cache_dir: Path, prefect_harness: None
) -> First:
    """The small convert, run once (through the flow: nothing is recorded yet)."""
    base = tmp_path_factory.mktemp("reuse")
    cfg = make_settings(base / "registry", base / "work", cache_dir)
    progress: list[Event] = []
    with spawns() as spawned, listening(progress.append):
        report = convert(_plan(demo_model), cfg)
    return First(cfg, report, spawned, progress)


def test_a_rerun_starts_no_engine_no_conversion_no_evaluation_and_no_flow_run(
    finished: First, demo_model: Path
) -> None:
    cfg, first = finished.settings, finished.report
    assert not first.ledger_only and {s["status"] for s in first.stages} == {"ran"}
    assert first.count("convert_base") == first.count("quantize") == first.count("evaluate") == 1
    assert any("evaluators.llamacpp.runner" in s for s in finished.spawned)
    assert {(e.stage, e.phase) for e in finished.progress} >= {("build", "start"), ("evaluate", "start")}
    # resolved once, before the flow (flows/reuse.py: while an embedded server would start), not again in it
    resolving = [e.phase for e in finished.progress if e.stage == "resolve" and e.detail == str(demo_model)]
    assert resolving == ["start", "done"]
    runs, registry = _flow_runs(), registry_snapshot(Path(cfg.registry))
    progress: list[Event] = []
    with spawns() as spawned, listening(progress.append):
        again = convert(_plan(demo_model), cfg)
    assert spawned == []  # no engine, converter or tool process
    # no stage started: the one event is the ledger's content hash of the source (its files' digests cached)
    assert [(e.stage, e.detail, e.phase) for e in progress] == [(RESOLVE_PARTS["hash"], str(demo_model), p)
                                                                for p in ("start", "done")]
    assert _flow_runs() == runs and registry_snapshot(Path(cfg.registry)) == registry
    assert again.ledger_only and again.ok
    assert [(s["stage"], s["status"]) for s in again.stages] == [(s["stage"], "reused") for s in first.stages]
    assert again.events == ["reuse:Q8_0"]  # no convert_base, quantize, window_set, reference, evaluate
    (variant,) = again.variants
    assert (variant.status, variant.eval_status, variant.ref) == ("reused", "reused", first.variants[0].ref)
    assert variant.quality == first.variants[0].quality


def test_the_report_is_the_flows_rerun_report(finished: First, demo_model: Path) -> None:
    from flows.quantize import convert_flow

    cfg = finished.settings
    fast = settled_report(_plan(demo_model), cfg)
    runs = _flow_runs()
    slow = convert_flow(_plan(demo_model), cfg)
    assert _flow_runs() == runs + 1  # the count does see a flow run
    assert fast is not None and fast.ledger_only and not slow.ledger_only
    # what this invocation found on the machine (the memory available, the free disk) differs from run to run; the
    # ledger's decision needs no pre-flight (nothing will run) and writes nothing
    ignored = {"wall_s", "ledger_only", "preflight", "disk_used"}
    assert fast.preflight is None and fast.disk_used == [] and slow.preflight is not None
    assert fast.model_dump(mode="json", exclude=ignored) == slow.model_dump(mode="json", exclude=ignored)


def test_work_to_do_goes_to_the_flow(finished: First, demo_model: Path) -> None:
    """--force, or a stage that is not recorded (a new variant): the flow runs (only decided here)."""
    cfg = finished.settings
    assert settled_report(_plan(demo_model).model_copy(update={"force": True}), cfg) is None
    assert settled_report(_plan(demo_model, "Q8_0,Q4_K_M"), cfg) is None
    # a source that is not there: the flow says so in its own words
    assert settled_report(_plan(demo_model.parent / "no-such-checkpoint"), cfg) is None


def test_a_source_that_fails_its_checks_stops_before_the_flow(finished: First, tmp_path: Path) -> None:
    from flows import steps
    from pipeline.errors import QuantyardError

    cfg = finished.settings
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    runs, registry = _flow_runs(), registry_snapshot(Path(cfg.registry))
    with pytest.raises(QuantyardError):
        convert(_plan(empty), cfg)
    assert _flow_runs() == runs and registry_snapshot(Path(cfg.registry)) == registry
    assert steps._PRERESOLVED == {}


def test_a_cli_run_without_a_server_starts_the_embedded_one_alongside_resolving(
        demo_model: Path, cache_dir: Path, tmp_path: Path) -> None:
    """``quantyard convert`` with no PREFECT_API_URL (``make demo``): Prefect's embedded server starts in a
    child while the source is resolved (flows/reuse.py, flows/embedded.py), the flow runs on it, and nothing
    is left running."""
    home = tmp_path / "prefect"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(home), QUANTYARD_WORK_DIR=str(tmp_path / "work"), QUANTYARD_CACHE_DIR=str(cache_dir))
    args = ["convert", str(demo_model), "--gguf", "Q8_0", "--no-eval", "--registry", str(tmp_path / "registry")]
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--json"], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert not report["ledger_only"] and report["variants"][0]["status"] == "registered"
    assert [s["status"] for s in report["stages"]] == ["ran"] * len(report["stages"])
    assert (home / "prefect.db").is_file()  # the embedded server's database: the flow ran on that server
    assert procs_with_env("PREFECT_HOME", str(home)) == []  # the embedded server inherits it


def test_a_cli_rerun_imports_no_prefect_and_says_so(finished: First, demo_model: Path) -> None:
    cfg, first = finished.settings, finished.report
    env = {**os.environ, "QUANTYARD_WORK_DIR": str(cfg.work_dir), "QUANTYARD_CACHE_DIR": str(cfg.cache_dir)}
    cli = [sys.executable, "-X", "importtime", "-m", "pipeline.cli"]  # -X importtime: every import, to stderr
    args = ["convert", str(demo_model), *FLAGS, "--registry", cfg.registry]
    proc = subprocess.run([*cli, *args, "--json"], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ledger_only"] and [s["status"] for s in report["stages"]] == ["reused"] * len(first.stages)
    assert re.findall(r"\|\s+(prefect\S*)\s*$", proc.stderr, re.MULTILINE) == []
    shown = CliRunner().invoke(app, args, env=env)
    assert shown.exit_code == 0, shown.output
    assert "every stage reused from the stage ledger: decided without starting Prefect" in shown.output
