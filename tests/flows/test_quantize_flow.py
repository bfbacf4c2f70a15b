"""End to end: the Prefect flow on the demo checkpoint, with a real registry and real engines."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from flows.quantize import convert_flow
from pipeline.cli import app
from pipeline.config import Settings
from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec, variants_from_flags
from registry import open_registry
from tests.conftest import DEMO_GGUF_TYPES, DEMO_WINDOWS

FAST_EVAL = EvalSpec(max_windows=12, speed=SpeedSpec(enabled=False))


def _plan(demo: Path, types: str, **kw: object) -> Plan:
    return Plan(source=SourceInput(source=str(demo)), model_name="demo", variants=variants_from_flags(gguf=types),
                eval=kw.pop("eval", FAST_EVAL), **kw)  # type: ignore[arg-type]


def _results_tables() -> dict[str, list[dict]]:
    """The ``quantyard-results-demo`` table artifacts on this session's Prefect server, by artifact id."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read() -> list:
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["quantyard-results-demo"])))

    artifacts = asyncio.run(read())
    assert all(a.type == "table" for a in artifacts)
    return {str(a.id): json.loads(a.data) if isinstance(a.data, str) else a.data for a in artifacts}


def test_convert_twice_end_to_end(demo_model: Path, settings: Settings, prefect_harness: None) -> None:
    """Two variants converted, evaluated, registered and published as the flow's results table (a Prefect
    table artifact); the same command again reuses everything."""
    before = _results_tables()
    report = convert_flow(_plan(demo_model, "Q8_0,Q4_K_M"), settings)
    assert report.ok and report.count("convert_base") == 1 and report.count("quantize") == 2
    published = [rows for key, rows in _results_tables().items() if key not in before]
    assert len(published) == 1 and sorted(r["variant"] for r in published[0]) == ["Q4_K_M", "Q8_0"], published
    assert all(r["ppl"] and r["kld"] is not None for r in published[0])
    reg = open_registry(settings.registry)
    variants = reg.list_variants("demo")
    assert sorted(v.name for v in variants) == ["Q4_K_M", "Q8_0"]
    assert all(v.versions == [1] for v in variants)
    for name, ftype in (("Q8_0", 7), ("Q4_K_M", 15)):
        view = reg.get_version(f"demo/{name}")
        (f,) = view.files
        blob = reg.blobs.path_of(f.sha256)
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == f.sha256 and blob.stat().st_size == f.size
        assert GGUFReader(str(blob)).get_field("general.file_type").contents() == ftype
        assert any(r.kind == "quality" and r.metrics["ppl"] > 1 for r in view.results)

    again = convert_flow(_plan(demo_model, "Q8_0,Q4_K_M"), settings)
    assert again.count("convert_base") == 0 and again.count("quantize") == 0 and again.count("evaluate") == 0
    assert again.count("reference") == 0 and again.count("window_set") == 0
    assert [v.status for v in again.variants] == ["reused", "reused"]
    assert all(v.versions == [1] for v in reg.list_variants("demo"))


def test_show_json_has_perplexity_and_lineage(demo_registry: Path) -> None:
    result = CliRunner().invoke(app, ["show", "demo/Q4_K_M", "--registry", str(demo_registry), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    quality = next(r for r in data["results"] if r["kind"] == "quality")
    assert quality["metrics"]["ppl"] > 1 and quality["window_set_id"]
    lineage = data["lineage"]
    assert lineage["source"]["content_hash"] and lineage["source"]["identity"].startswith("local:sha256:")
    assert lineage["tool"]["name"] == "llama.cpp" and lineage["tool"]["llama_cpp_python"] == "0.3.36"
    assert lineage["tool"]["llama_cpp_commit"] not in ("", "unknown")
    assert lineage["parameters"]["type"] == "Q4_K_M" and lineage["parameters"]["base_type"] == "F16"
    assert data["ref"] == "demo/Q4_K_M@1"


def test_reference_reused_by_new_variant_and_force_makes_new_version(demo_model: Path, settings: Settings,
                                                                     prefect_harness: None) -> None:
    first = convert_flow(_plan(demo_model, "Q8_0"), settings)
    assert first.count("reference") == 1 and first.count("window_set") == 1
    second = convert_flow(_plan(demo_model, "Q8_0,Q5_K_M"), settings)
    assert second.count("reference") == 0 and second.count("window_set") == 0 and second.count("convert_base") == 0
    assert second.count("quantize") == 1 and second.count("evaluate") == 1
    forced = convert_flow(_plan(demo_model, "Q8_0", force=True), settings)
    assert forced.variants[0].ref == "demo/Q8_0@2" and forced.count("quantize") == 1
    assert forced.count("reference") == 0


def _kill_runner_for(model_marker: str, work: Path, stop: threading.Event) -> None:
    """SIGKILL the llama.cpp runner evaluating ``model_marker`` in this test's work folder (another test's
    runners, on another xdist worker, are left alone)."""
    while not stop.is_set():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
                if b"evaluators.llamacpp.runner" not in args:
                    continue
                request = json.loads(Path(args[-2].decode()).read_text())
            except (OSError, ValueError):
                continue
            if model_marker in request["model"] and request["out_dir"].startswith(str(work)):
                os.kill(int(entry.name), signal.SIGKILL)
                return
        time.sleep(0.02)


def test_killed_runner_fails_only_its_variant(demo_model: Path, settings: Settings, prefect_harness: None) -> None:
    stop = threading.Event()
    killer = threading.Thread(target=_kill_runner_for, args=("-Q8_0.gguf", settings.work_dir, stop), daemon=True)
    killer.start()
    try:
        report = convert_flow(_plan(demo_model, "Q8_0,Q4_K_M,Q2_K"), settings)
    finally:
        stop.set()
        killer.join()
    by = {v.variant: v for v in report.variants}
    assert by["Q8_0"].eval_status == "failed" and "EngineError" in (by["Q8_0"].eval_error or "")
    assert by["Q4_K_M"].eval_status == "ok" and by["Q2_K"].eval_status == "ok"
    reg = open_registry(settings.registry)
    assert {v.name for v in reg.list_variants("demo")} == {"Q8_0", "Q4_K_M", "Q2_K"}
    failed = reg.get_version("demo/Q8_0").results
    assert [r.status for r in failed] == ["failed"] and "SIGKILL" in (failed[0].error or "")
    # a re-run evaluates only what is missing
    rerun = convert_flow(_plan(demo_model, "Q8_0,Q4_K_M,Q2_K"), settings)
    assert rerun.count("evaluate") == 1 and rerun.count("quantize") == 0


def test_a_format_whose_preparation_fails_fails_only_its_variants(tmp_path: Path, demo_model: Path,
                                                                  settings: Settings, prefect_harness: None) -> None:
    """llama.cpp's converter refuses an unknown BPE pre-tokenizer while preparing the GGUF base: the run
    stopped there, and the EXL2 variant asked beside it was never built. Now the GGUF variant fails with that
    error and the EXL2 one is built, registered and evaluated, as the distributed executor already did; with
    one format the run still stops on the error (exit 2: tests/pipeline/test_cli.py)."""
    from pipeline.errors import TokenizerUnsupportedError
    from tests.factories import bytelevel_bpe_checkpoint

    source = bytelevel_bpe_checkpoint(tmp_path / "bpe", demo_model)
    plan = Plan(source=SourceInput(source=str(source)), model_name="bpe",
                variants=variants_from_flags(gguf="Q8_0", exl2="4.0"),
                eval=EvalSpec(window=128, stride=128, max_windows=2, speed=SpeedSpec(enabled=False)))
    report = convert_flow(plan, settings)
    by = {v.variant: v for v in report.variants}
    gguf, exl2 = by["Q8_0"], by["EXL2-4.0bpw-ref"]
    assert gguf.status == "failed" and gguf.error_type == "TokenizerUnsupportedError", gguf
    assert "pre-tokenizer" in (gguf.error or "")
    assert exl2.status == "registered" and exl2.eval_status == "ok", exl2
    # the noise floor would run llama.cpp on that GGUF base: it says why there is none, and fails nothing
    floor = report.noise_floor or {}
    assert floor.get("engine") is None and "TokenizerUnsupportedError" in str(floor.get("reason")), floor
    assert {v.name for v in open_registry(settings.registry).list_variants("bpe")} == {"EXL2-4.0bpw-ref"}
    with pytest.raises(TokenizerUnsupportedError, match="pre-tokenizer"):
        convert_flow(plan.model_copy(update={"variants": variants_from_flags(gguf="Q8_0")}), settings)


def test_dataset_spec_parsing() -> None:
    import pytest

    from pipeline.errors import ConfigError
    from pipeline.texts import parse_dataset_spec

    assert parse_dataset_spec("wikitext:wikitext-2-raw-v1:test") == ("wikitext", "wikitext-2-raw-v1", "test", "text")
    assert parse_dataset_spec("c4:validation") == ("c4", None, "validation", "text")
    assert parse_dataset_spec("x:cfg:train:content") == ("x", "cfg", "train", "content")
    with pytest.raises(ConfigError):
        parse_dataset_spec("justaname")


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_evaluations_at_once_give_the_numbers_of_one_after_another(
        demo_model: Path, demo_registry_template: dict, settings: Settings, prefect_harness: None) -> None:
    """The template measured speed, so its evaluations ran one after another on both threads; three of its
    variants without speed and with ``eval_jobs=0`` run all at once on one thread each (flows/schedule.py),
    and every quality figure is the same: the schedule changes the wall time, not the numbers."""
    template = demo_registry_template["report"]
    assert template.eval_schedule["at_once"] == 1 and "speed is measured" in template.eval_schedule["reason"]
    types = [t for t in DEMO_GGUF_TYPES if t != "F16"]
    plan = _plan(demo_model, ",".join(types), eval=EvalSpec(max_windows=DEMO_WINDOWS, speed=SpeedSpec(enabled=False)))
    report = convert_flow(plan, settings.model_copy(update={"eval_jobs": 0}))
    assert report.ok and report.count("evaluate") == len(types) == 3
    schedule = report.eval_schedule
    assert (schedule["evaluations"], schedule["at_once"], schedule["threads"]) == (3, 3, [1] * 3), schedule
    evals = [e for e in report.stages if e["stage"].startswith("evaluate:")]
    spans = [(e["start_s"], e["start_s"] + e["dispatch_s"]) for e in evals]
    assert len(spans) == 3 and _most_at_once(spans) == 3, spans
    reg = open_registry(settings.registry)
    before = {v.variant: v for v in template.variants}
    for v in report.variants:
        (quality,) = [r for r in reg.get_version(v.ref or "").results if r.kind == "quality"]
        assert quality.hardware["threads"] == 1
        old = before[v.variant].quality or {}
        assert v.quality is not None and v.window_set_id == before[v.variant].window_set_id
        for key in ("ppl", "nll_mean", "kld_mean", "kld_p99", "top1_agreement", "n_tokens"):
            assert v.quality[key] == pytest.approx(old[key], rel=1e-9, abs=1e-12), (v.variant, key)
