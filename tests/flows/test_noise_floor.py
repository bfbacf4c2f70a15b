"""The noise floor: the KLD between the reference and a second unquantized run of the same source that differs
only in arithmetic, measured once per source and reference, kept in the registry and shown beside every KLD.

Measured on the demo checkpoint by the real flow (``demo_registry_template``: a transformers float32 reference, the
floor on llama.cpp with the run's GGUF base); which second run is chosen is checked on published shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from evaluators.reference import noise_floor_engine
from flows.quantize import convert_flow
from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec, variants_from_flags
from pipeline.resources import GIB, Memory
from pipeline.shown import NOISE_FLOOR_KIND, WITHIN_FLOOR, table_rows, within_floor
from registry import open_registry
from tests.conftest import make_settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_preflight import shape_facts

MACHINE = Memory(total=24 * GIB, available=22 * GIB, limited_by="MemAvailable")
TRANSFORMERS = EvalSpec(reference_engine="transformers", reference_dtype="float32", reference_device="cpu")
LLAMA = EvalSpec(reference_engine="llama.cpp", reference_dtype="auto", reference_device="cpu")


def test_the_second_run_is_the_other_cpu_engine_where_it_fits() -> None:
    small, big = shape_facts("tiny", vocab=49152), shape_facts("llama3-8b")
    assert noise_floor_engine(TRANSFORMERS, small, MACHINE, has_gguf_base=True)[0] == "llama.cpp"
    engine, why = noise_floor_engine(TRANSFORMERS, small, MACHINE, has_gguf_base=False)
    assert engine is None and "no GGUF base" in why
    assert noise_floor_engine(LLAMA, small, MACHINE, has_gguf_base=True)[0] == "transformers"
    engine, why = noise_floor_engine(LLAMA, big, MACHINE, has_gguf_base=True)  # fp32 8B: ~30 GiB, 22 available
    assert engine is None and "ESTIMATE" in why and "22.0 GiB" in why
    engine, why = noise_floor_engine(LLAMA.model_copy(update={"reference_engine": "vllm", "reference_device": "cuda"}),
                                     small, MACHINE, has_gguf_base=True)
    assert engine is None and "vllm" in why


def test_the_floor_is_measured_once_and_kept(demo_registry_template: dict[str, object], cache_dir: Path) -> None:
    report = demo_registry_template["report"]
    floor = report.noise_floor  # type: ignore[attr-defined]
    assert floor is not None and floor["engine"] == "llama.cpp", floor
    assert floor["kld_mean"] > 0 and floor["kld_ci95_low"] <= floor["kld_mean"] <= floor["kld_ci95_high"]
    assert floor["kld_mean"] <= floor["kld_p99"] <= floor["kld_max"]
    assert floor["window_set_id"] == report.window_set["id"]  # type: ignore[attr-defined]
    assert {v.quality["reference_key"] for v in report.variants} == {floor["reference_key"]}  # type: ignore
    reg = open_registry(make_settings(Path(str(demo_registry_template["registry"])),
                                      Path(str(demo_registry_template["work"])), cache_dir))
    kept = reg.list_source_artifacts(report.source["identity"], NOISE_FLOOR_KIND)  # type: ignore[attr-defined]
    assert len(kept) == 1 and kept[0].meta["kld_mean"] == floor["kld_mean"]
    assert kept[0].meta["usage"]["wall_s"] > 0  # what it cost is recorded like any stage's


def test_quantized_variants_sit_above_the_floor_and_f16_within_it(demo_registry_template: dict[str, object]) -> None:
    """The F16 variant is the unquantized model on llama.cpp: the same arithmetic difference the floor measures.
    Q2_K is far from the reference: it must not be within the floor."""
    report = demo_registry_template["report"]
    floor = report.noise_floor  # type: ignore[attr-defined]
    rows = {r["variant"]: r for r in table_rows(report.variants, floor)}  # type: ignore[attr-defined]
    assert rows["F16"]["within_noise_floor"] and WITHIN_FLOOR.key in rows["F16"]["marks"]
    assert not rows["Q2_K"]["within_noise_floor"] and WITHIN_FLOOR.key not in rows["Q2_K"]["marks"]
    assert rows["Q2_K"]["kld"] > 10 * floor["kld_mean"]
    assert all(r["kld_p99"] >= r["kld"] for r in rows.values())


def test_within_floor_compares_intervals() -> None:
    floor = {"kld_mean": 1e-4, "kld_ci95_low": 8e-5, "kld_ci95_high": 1.2e-4}
    assert within_floor({"kld": 1.5e-4, "kld_ci95_low": 1.1e-4}, floor)
    assert not within_floor({"kld": 1.5e-4, "kld_ci95_low": 1.3e-4}, floor)
    assert within_floor({"kld": 1e-4}, floor)  # no interval: the value itself
    assert not within_floor({"kld": None, "kld_lower_bound": 1e-5}, floor)  # a bound is not an exact KLD
    assert not within_floor({"kld": 1e-5}, None) and not within_floor({"kld": 1e-5}, {"engine": None})


@pytest.mark.slow
def test_against_a_llama_cpp_reference_the_floor_runs_transformers(tmp_path: Path, demo_model: Path, cache_dir: Path,
                                                                   prefect_harness: None) -> None:
    """The other direction: a llama.cpp reference (the GGUF base), the floor from transformers float32 on the
    checkpoint; a second run of the same plan reuses it (one artifact)."""
    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo",
                variants=variants_from_flags(gguf="Q8_0"),
                eval=EvalSpec(max_windows=4, reference_engine="llama.cpp", speed=SpeedSpec(enabled=False)))
    report = convert_flow(plan, cfg)
    assert report.ok and report.noise_floor is not None, report.noise_floor
    floor = report.noise_floor
    assert floor["engine"] == "transformers" and floor["kld_mean"] > 0
    assert floor["engine_version"].startswith("transformers"), floor["engine_version"]
    again = convert_flow(plan, cfg)
    assert again.noise_floor is not None and again.noise_floor["kld_mean"] == floor["kld_mean"]
    reg = open_registry(cfg)
    assert len(reg.list_source_artifacts(report.source["identity"], NOISE_FLOOR_KIND)) == 1
