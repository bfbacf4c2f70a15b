"""imatrix quants on the demo checkpoint: llama-imatrix once per source and calibration, applied to every
requested type, recorded (calibration sha256, chunks, context) and registered as source artifacts; IQ types
refused without one."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import GGUFConverter, ImatrixRequest
from converters.gguf.imatrix import ensure_imatrix
from converters.source import resolve_source
from flows.quantize import convert_flow
from flows.validate import ValidateOptions, validate
from pipeline.cli import app
from pipeline.config import Settings
from pipeline.errors import ConfigError, InvalidSpecError
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.plan import CalibrationSpec, EvalSpec, GGUFOptions, Plan, SourceInput, SpeedSpec, variants_from_flags
from pipeline.policy import Policy
from pipeline.specs import GGUFSpec
from registry import open_registry
from tests.conftest import DEMO_WINDOWS, make_settings, registry_snapshot

CHUNKS = 4  # 4 x 512 calibration tokens: one llama-imatrix pass, enough to exercise the path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_iq_types_require_an_imatrix(demo_model: Path, registry_path: Path, settings: Settings) -> None:
    with pytest.raises(InvalidSpecError, match="IQ4_XS, IQ2_M need") as info:
        variants_from_flags(gguf="Q4_K_M,IQ4_XS,IQ2_M")
    assert "--imatrix" in str(info.value)
    assert [s.name for s in variants_from_flags(gguf="F16,Q4_K_M,IQ3_M", imatrix=True)] == ["F16", "i1-Q4_K_M",
                                                                                          "i1-IQ3_M"]
    with pytest.raises(InvalidSpecError, match="IQ3_M"):  # plans built without the CLI are checked too
        GGUFConverter(settings).check(load_checkpoint(demo_model), [GGUFSpec(type="IQ3_M")])
    before = registry_snapshot(registry_path)
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "IQ4_XS", "--registry",
                                      str(registry_path)])
    assert result.exit_code == 2 and "--imatrix" in result.output
    assert registry_snapshot(registry_path) == before


def test_imatrix_and_plain_q4km_both_registered_with_distinct_lineage(
        demo_model: Path, demo_registry: Path, demo_registry_template: dict[str, object], cache_dir: Path,
        prefect_harness: None) -> None:
    cfg = make_settings(demo_registry, demo_registry_template["work"], cache_dir)  # type: ignore[arg-type]
    plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo",
                variants=variants_from_flags(gguf="Q4_K_M,IQ4_XS", imatrix=True),
                eval=EvalSpec(max_windows=DEMO_WINDOWS, speed=SpeedSpec(enabled=False)),
                gguf=GGUFOptions(calibration=CalibrationSpec(chunks=CHUNKS)))
    report = convert_flow(plan, cfg)
    assert report.ok, report
    assert report.count("imatrix") == 1 and report.count("quantize") == 2 and report.count("convert_base") == 0
    assert report.count("reference") == 0  # same windows and reference as the plain variants

    reg = open_registry(cfg.registry)
    plain, i1 = reg.get_version("demo/Q4_K_M"), reg.get_version("demo/i1-Q4_K_M")
    assert plain.lineage["parameters"]["imatrix"] is None
    im = i1.lineage["parameters"]["imatrix"]
    assert im["calibration_sha256"] == _sha256(demo_model / "calibration.txt")
    assert im["calibration_origin"] == "checkpoint:calibration.txt"
    assert (im["chunks"], im["chunks_requested"], im["context"]) == (CHUNKS, CHUNKS, 512)
    assert reg.get_version("demo/i1-IQ4_XS").lineage["parameters"]["imatrix"] == im  # one imatrix, every type
    assert plain.build_key != i1.build_key and plain.files[0].sha256 != i1.files[0].sha256

    artifacts = {a.kind: a for a in reg.list_source_artifacts(i1.source["identity"])}
    assert artifacts["imatrix"].sha256 == im["sha256"] and artifacts["imatrix"].meta["chunks"] == CHUNKS
    assert artifacts["calibration"].sha256 == im["calibration_sha256"]
    assert _sha256(reg.artifact_path(artifacts["imatrix"])) == im["sha256"]

    klds = {}
    for view in (plain, i1):
        quality = next(r for r in view.results if r.kind == "quality" and r.status == "ok")
        assert quality.window_set_id == report.window_set["id"]  # type: ignore[index]
        klds[view.variant] = quality.metrics["kld_mean"]
    print("KLD on the demo window set:", klds)  # reported, not asserted: a tiny model may not show the gain

    # validate --reproduce rebuilds i1-IQ4_XS with the recorded calibration (chunks, and the text by its sha256
    # from the registry); a default plan would calibrate on every chunk and fail the check falsely
    assert i1.lineage["options"]["calibration"]["chunks"] == CHUNKS
    report = validate("demo/i1-IQ4_XS", cfg, ValidateOptions(policy=Policy(), reproduce=True))
    check = next(c for c in report.checks if c.name == "reproducibility")
    assert check.status == "pass", check.message

    again = convert_flow(plan, cfg)
    assert again.count("imatrix") == 0 and {v.status for v in again.variants} == {"reused"}


def test_too_short_calibration_is_a_clear_error(demo_model: Path, demo_registry_template: dict[str, object],
                                                cache_dir: Path, tmp_path: Path) -> None:
    cfg = make_settings(tmp_path / "registry", demo_registry_template["work"], cache_dir)  # type: ignore[arg-type]
    ctx = BuildContext(checkpoint=load_checkpoint(demo_model), source=resolve_source(str(demo_model),
                       cache_dir=cache_dir), model_name="demo", settings=cfg)
    base = Path(GGUFConverter(cfg).prepare(ctx, []).paths["base"])
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x\n" * 10)
    work = tmp_path / "imatrix"
    work.mkdir()
    request = ImatrixRequest(calibration=short, origin="file:short.txt")
    with pytest.raises(ConfigError, match="too short") as info:
        ensure_imatrix(base, work, request, request.key("F16", {}), toolchain=llama_cpp_toolchain(cfg),
                       threads=cfg.threads, timeout_s=120)
    assert "--calibration" in str(info.value)
    assert not list(work.glob("imatrix-*.gguf"))
    shutil.rmtree(work)
