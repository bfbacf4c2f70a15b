"""The pre-flight (flows/preflight.py): the reference engine chosen from the source's size and this machine's
memory before any work, a plan that cannot fit refused before any work with what it needs, what is there and what
would fit, and a format that cannot fit refused without stopping the others."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evaluators.reference import choose_reference, reference_need
from pipeline.cli import app
from pipeline.errors import InsufficientMemoryError
from pipeline.footprint import ModelFacts
from pipeline.plan import EvalSpec
from pipeline.resources import GIB, Memory
from tests.conftest import registry_snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import synthetic


def shape_facts(shape: str, vocab: int = 128256, dtype: str = "bfloat16") -> ModelFacts:
    """The facts of a checkpoint of a published shape, from its tensor table alone (no 15 GB file needed)."""
    cfg = {**synthetic.SHAPES[shape], "vocab_size": vocab, "model_type": "llama"}
    shapes = {name: dims for name, dims, _ in synthetic.tensor_shapes(synthetic.SHAPES[shape], vocab)}
    per = 4 if dtype == "float32" else 2
    return ModelFacts.from_config(cfg, shapes, sum(math.prod(s) for s in shapes.values()) * per, dtype)


MACHINE = Memory(total=24 * GIB, available=22 * GIB, limited_by="MemAvailable")


def test_an_8b_source_on_a_24_gib_machine_takes_the_memory_mapped_gguf_reference() -> None:
    """The case that was killed by the OOM killer: Llama-3-8B's shape in float32 needs about 30 GB."""
    facts = shape_facts("llama3-8b")
    assert 7.9e9 < facts.n_params < 8.1e9  # Llama-3-8B: 8.03 B parameters with its 128,256-token vocabulary
    spec = choose_reference(EvalSpec(), facts, MACHINE, gguf_base="auto")
    assert (spec.reference_engine, spec.reference_dtype, spec.reference_device) == ("llama.cpp", "auto", "cpu")
    assert "transformers float32 would need ~3" in str(spec.reference_reason), spec.reference_reason
    assert "ESTIMATE" in str(spec.reference_reason)
    assert reference_need(spec, facts).memory < 4 * GIB  # its own buffers: the file is memory-mapped


def test_a_small_source_keeps_the_float32_transformers_reference() -> None:
    facts = shape_facts("tiny", vocab=49152)
    spec = choose_reference(EvalSpec(), facts, MACHINE)
    assert (spec.reference_engine, spec.reference_dtype, spec.reference_device) == ("transformers", "float32", "cpu")
    assert str(spec.reference_reason).startswith("auto: transformers float32 on the CPU fits")


def test_a_gpu_that_holds_the_model_takes_bfloat16_there() -> None:
    spec = choose_reference(EvalSpec(), shape_facts("llama3-8b"), MACHINE, gpu_free=80 * GIB)
    assert (spec.reference_engine, spec.reference_dtype, spec.reference_device) == ("transformers", "bfloat16", "cuda")


def test_a_named_engine_that_cannot_fit_is_refused_naming_one_that_would() -> None:
    with pytest.raises(InsufficientMemoryError) as caught:
        choose_reference(EvalSpec(reference_engine="transformers"), shape_facts("llama3-8b"), MACHINE)
    err = caught.value
    assert err.needed > err.available == MACHINE.available
    assert "--reference-engine llama.cpp" in str(err.hint) and "22.0 GiB available" in err.message


def test_a_70b_source_fits_nowhere_on_a_small_budget_and_says_so() -> None:
    small = Memory(total=GIB, available=GIB // 4, limited_by="QUANTYARD_MEMORY_BUDGET")
    with pytest.raises(InsufficientMemoryError) as caught:
        choose_reference(EvalSpec(), shape_facts("llama3-70b"), small)
    assert "the reference: llama.cpp" in caught.value.message and "QUANTYARD_MEMORY_BUDGET" in caught.value.message


def test_dtype_without_an_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="without a reference engine"):
        EvalSpec(reference_dtype="bfloat16")


def _json(output: str) -> dict:
    return json.loads(output[output.index("{"):])


def test_a_plan_whose_reference_cannot_fit_is_refused_before_any_work(tmp_path: Path, demo_model: Path,
                                                                      demo_registry: Path) -> None:
    before = registry_snapshot(demo_registry)
    work = tmp_path / "work"
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q8_0", "--name", "small", "--registry",
                                      str(demo_registry), "--no-speed", "--json"],
                                env={"QUANTYARD_MEMORY_BUDGET": "200M", "QUANTYARD_WORK_DIR": str(work)})
    assert result.exit_code == 2, result.output
    said = _json(result.stdout)
    assert said["type"] == "InsufficientMemoryError", said
    assert "refused before any work" in said["message"] and "200 MiB available (QUANTYARD_MEMORY_BUDGET" in \
        said["message"], said
    assert "~" in said["message"] and "ESTIMATE" in said["message"]  # what it needs, labelled an estimate
    assert "options:" in said["hint"] and "GPU" in said["hint"], said
    assert registry_snapshot(demo_registry) == before
    assert not (work / "gguf-base").exists()  # nothing was converted


def test_a_format_that_cannot_fit_is_refused_and_the_others_go_on(tmp_path: Path, demo_model: Path,
                                                                   demo_registry: Path, prefect_harness: None) -> None:
    """At 1.2 GiB the demo's float32 reference (about 1 GiB, ESTIMATE) is not comfortable, so llama.cpp's runs on
    the F16 base; vLLM's engine alone takes more: AWQ is refused, GGUF is built, registered and evaluated."""
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q8_0", "--awq", "--name", "mixed",
                                      "--registry", str(demo_registry), "--no-speed", "--max-windows", "2", "--json"],
                                env={"QUANTYARD_MEMORY_BUDGET": "1200M", "QUANTYARD_WORK_DIR": str(tmp_path / "w")})
    assert result.exit_code == 2, result.output  # a part of the plan was refused
    report = _json(result.stdout)
    by_name = {v["variant"]: v for v in report["variants"]}
    assert by_name["Q8_0"]["status"] == "registered" and by_name["Q8_0"]["quality"]["kld_mean"] is not None
    awq = next(v for v in report["variants"] if v["format"] == "awq")
    assert awq["status"] == "refused" and awq["error_type"] == "InsufficientMemoryError", awq
    assert "AWQ" in awq["error"] and "1.2 GiB available" in awq["error"]
    assert report["preflight"]["reference"]["engine"] == "llama.cpp", report["preflight"]
    assert report["reference"]["engine"] == "llama.cpp" and "auto:" in report["reference"]["reason"]
    assert report["preflight"]["refused"].keys() == {"awq"}
    assert all(n["estimate"] for n in report["preflight"]["needs"])


def test_stages_record_their_time_and_memory(demo_registry_template: dict[str, object], cache_dir: Path) -> None:
    """Every stage that ran, every build's lineage and every evaluation's results say what they took."""
    from registry import open_registry
    from tests.conftest import make_settings

    report = demo_registry_template["report"]
    ran = [s for s in report.stages if s["status"] == "ran"]  # type: ignore[attr-defined]
    assert ran and all(s["usage"]["wall_s"] >= 0 and s["usage"]["peak_in_use_bytes"] > 0 for s in ran)
    reference = next(s for s in ran if s["stage"] == "reference")
    assert reference["usage"]["peak_process_bytes"] > 50 * 2**20  # the runner's own memory, not the machine's
    reg = open_registry(make_settings(Path(str(demo_registry_template["registry"])),
                                      Path(str(demo_registry_template["work"])), cache_dir))
    for v in report.variants:  # type: ignore[attr-defined]
        version = reg.get_version(v.ref)
        assert version.lineage["usage"]["wall_s"] > 0, version.lineage.keys()
        quality = [r for r in version.results if r.kind == "quality" and r.status == "ok"]
        assert quality and all(r.metrics["usage"]["peak_process_bytes"] > 0 for r in quality)
