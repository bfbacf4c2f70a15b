"""The EXL2 converter: backend choice, fail-fast checks, and the reference-cpu backend end to end on
the demo checkpoint (through the real flow: measured once, built at 4.0/6.0/8.0 bpw, registered)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from converters.checkpoint import load_checkpoint, read_safetensors_header
from converters.exl2.converter import EXL2Converter
from pipeline.config import Settings
from pipeline.errors import ToolchainMissingError, UnsupportedArchitectureError
from pipeline.exl2_codec import decode, layer_prefixes, split_layer
from pipeline.specs import EXL2Backend, EXL2Spec
from registry import open_registry
from tests.exl2_support import exl2_demo  # noqa: F401  (session fixture)
from tests.factories import arch_checkpoint, copy_checkpoint, edit_config

BPWS = (4.0, 6.0, 8.0)


def test_without_exllamav2_an_open_backend_becomes_reference_cpu(settings: Settings) -> None:
    conv = EXL2Converter(settings)
    assert conv.resolve_spec(EXL2Spec(bpw=4.0)).backend == EXL2Backend.REFERENCE_CPU
    assert conv.resolve_spec(EXL2Spec(bpw=4.0)).name == "EXL2-4.0bpw-ref"
    forced = EXL2Spec(bpw=4.0, backend=EXL2Backend.EXLLAMAV2)
    assert conv.resolve_spec(forced) is forced


def test_forcing_exllamav2_without_it_fails_fast_and_says_what_to_do(settings: Settings, demo_model: Path) -> None:
    conv = EXL2Converter(settings)
    with pytest.raises(ToolchainMissingError) as info:
        conv.check(load_checkpoint(demo_model), [EXL2Spec(bpw=4.0, backend=EXL2Backend.EXLLAMAV2)])
    assert "QUANTYARD_EXL2_PYTHON" in str(info.value) and "reference-cpu" in str(info.value)


def test_an_interpreter_without_exllamav2_or_cuda_is_reported(settings: Settings) -> None:
    from pipeline import exl2_env

    cfg = settings.model_copy(update={"exl2_python": sys.executable})  # has torch, no exllamav2, no CUDA
    reason = exl2_env.unavailable_reason(cfg)
    assert reason is not None and ("exllamav2 is not installed" in reason or "no CUDA" in reason)
    assert EXL2Converter(cfg).resolve_spec(EXL2Spec(bpw=4.0)).backend == EXL2Backend.REFERENCE_CPU


def test_widths_that_are_not_multiples_of_32_are_refused(tmp_path: Path, demo_model: Path,
                                                         settings: Settings) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    edit_config(ckpt, intermediate_size=770)
    with pytest.raises(UnsupportedArchitectureError, match="intermediate_size"):
        EXL2Converter(settings).check(load_checkpoint(ckpt, check_shapes=False), [EXL2Spec(bpw=4.0)])


def test_an_architecture_exllamav2_does_not_load_is_refused_for_every_backend(tmp_path: Path, demo_model: Path,
                                                                               settings: Settings) -> None:
    """ExLlamaV2 loads an architecture it does not know as a Llama: an EXL2 of Falcon would be unreadable."""
    ckpt = load_checkpoint(arch_checkpoint(tmp_path / "falcon", demo_model, "falcon", layers=1))
    for backend in EXL2Backend:
        with pytest.raises(UnsupportedArchitectureError, match=r"ExLlamaV2 0\.3\.2 does not load FalconForCausalLM"):
            EXL2Converter(settings).check(ckpt, [EXL2Spec(bpw=4.0, backend=backend)])


def test_the_reference_codec_refuses_weights_it_would_leave_unquantized(tmp_path: Path, demo_model: Path,
                                                                       settings: Settings) -> None:
    """Mixtral is an ExLlamaV2 architecture, but transformers 5 holds its experts as fused 3-D parameters, not
    nn.Linear: the reference codec would write them in fp16 under names ExLlamaV2 does not read."""
    ckpt = load_checkpoint(arch_checkpoint(tmp_path / "mixtral", demo_model, "mixtral", layers=1))
    with pytest.raises(UnsupportedArchitectureError) as info:
        EXL2Converter(settings).check(ckpt, [EXL2Spec(bpw=4.0, backend=EXL2Backend.REFERENCE_CPU)])
    assert "model.layers.0.mlp.experts.gate_up_proj" in info.value.message
    assert "would stay unquantized" in info.value.message and "exllamav2" in str(info.value.hint)
    EXL2Converter(settings).check(load_checkpoint(demo_model), [EXL2Spec(bpw=4.0, backend=EXL2Backend.REFERENCE_CPU)])


# --- end to end (reference-cpu) -------------------------------------------------------------------


def _by_name(report: Any) -> dict[str, Any]:
    return {v.variant: v for v in report.variants}


@pytest.mark.slow
def test_demo_to_exl2_is_measured_once_built_registered_and_evaluated(exl2_demo: dict[str, Any]) -> None:  # noqa: F811
    report = exl2_demo["report"]
    assert report.ok and report.count("measure") == 1 and report.count("quantize") == len(BPWS) + 1  # + Q8_0
    by = _by_name(report)
    assert set(by) == {f"EXL2-{b}bpw-ref" for b in BPWS} | {"Q8_0"}
    assert by.pop("Q8_0").engine == "llama.cpp"  # one flow, one table, each format on its engine
    for v in by.values():
        assert v.status == "registered" and v.engine == "exl2-reference" and v.eval_status == "ok"
    kld = {b: by[f"EXL2-{b}bpw-ref"].quality["kld_mean"] for b in BPWS}
    assert kld[6.0] < kld[4.0]
    q8 = by["EXL2-8.0bpw-ref"].quality
    assert abs(q8["ppl"] / q8["ref_ppl"] - 1) < 0.01


def test_lineage_names_backend_calibration_and_measurement(exl2_demo: dict[str, Any],  # noqa: F811
                                                           demo_model: Path) -> None:
    cfg, report = exl2_demo["settings"], exl2_demo["report"]
    reg = open_registry(cfg.registry)
    view = reg.get_version("demo/EXL2-4.0bpw-ref")
    lineage = view.lineage
    assert lineage["spec"]["backend"] == "reference-cpu" and lineage["tool"]["backend"] == "reference-cpu"
    calib = lineage["parameters"]["calibration"]
    text = (demo_model / "calibration.txt").read_text(encoding="utf-8")
    import hashlib

    assert calib["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert calib["origin"] == "checkpoint:calibration.txt" and calib["rows"] >= 1 and calib["length"] >= 16
    assert calib["rows"] * calib["length"] <= calib["text_tokens"]
    (art,) = reg.list_source_artifacts(report.source["identity"], "exl2_measurement")
    assert art.key == lineage["parameters"]["measurement_key"] and art.meta["backend"] == "reference-cpu"
    measurement = json.loads(reg.artifact_path(art).read_text())
    assert measurement["calibration"]["text_sha256"] == calib["sha256"]
    assert len(measurement["layers"]) == 4 * 7  # every decoder linear of the demo, measured once
    config = json.loads(next(reg.blobs.path_of(f.sha256) for f in view.files if f.name == "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl2"
    assert config["quantization_config"]["bits"] == 4.0 and config["quantization_config"]["head_bits"] == 6


def test_bpw_accounting_matches_the_tensor_bytes_on_disk(exl2_demo: dict[str, Any],  # noqa: F811
                                                         demo_model: Path) -> None:
    reg = open_registry(exl2_demo["settings"].registry)
    source = read_safetensors_header(demo_model / "model.safetensors")
    sizes = {"I32": 32, "I16": 16, "F16": 16}
    for bpw in BPWS:
        view = reg.get_version(f"demo/EXL2-{bpw}bpw-ref")
        blob = next(reg.blobs.path_of(f.sha256) for f in view.files if f.name == "output.safetensors")
        headers = read_safetensors_header(blob)
        bits = numel = 0
        for prefix in layer_prefixes(list(headers)):
            if prefix == "lm_head":
                continue
            numel += math.prod(source[f"{prefix}.weight"].shape)
            bits += sum(math.prod(info.shape) * sizes[info.dtype] for name, info in headers.items()
                        if name.rsplit(".", 1)[0] == prefix)
        on_disk = bits / numel
        computed = view.lineage["parameters"]["decoder_bpw"]  # from the allocation, before anything was written
        assert abs(computed / on_disk - 1) < 0.01
        assert view.lineage["info"]["decoder_bpw_on_disk"] == pytest.approx(on_disk)
        assert bpw - 0.5 < on_disk <= bpw + 1e-9  # meets the target without wasting the budget


def test_written_layers_decode_and_follow_exllamav2_rules(exl2_demo: dict[str, Any]) -> None:  # noqa: F811
    reg = open_registry(exl2_demo["settings"].registry)
    view = reg.get_version("demo/EXL2-4.0bpw-ref")
    blob = next(reg.blobs.path_of(f.sha256) for f in view.files if f.name == "output.safetensors")
    with safe_open(str(blob), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    prefixes = layer_prefixes(list(tensors))
    assert "lm_head" in prefixes and len(prefixes) == 29
    widths = set()
    for p in prefixes:
        layer = decode(split_layer(tensors, p))
        widths |= {g.bits for g in layer.groups}
        if p == "lm_head":
            assert {g.bits for g in layer.groups} == {6}
    assert len(widths) >= 2  # the allocation mixes widths across layers
    assert tensors["model.embed_tokens.weight"].dtype.is_floating_point and \
        str(tensors["model.embed_tokens.weight"].dtype) == "torch.float16"


def test_rerun_reuses_every_variant(exl2_demo: dict[str, Any], prefect_harness: None) -> None:  # noqa: F811
    from flows.quantize import convert_flow

    again = convert_flow(exl2_demo["plan"], exl2_demo["settings"])
    assert again.count("measure") == 0 and again.count("quantize") == 0 and again.count("evaluate") == 0
    assert all(v.status == "reused" for v in again.variants)


def test_compare_lists_gguf_and_exl2_with_their_engines(exl2_demo: dict[str, Any]) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, ["compare", "demo", "--registry", str(exl2_demo["settings"].registry),
                                      "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["variant"]: r for r in json.loads(result.stdout)}
    assert rows["Q8_0"]["engine"] == "llama.cpp" and rows["EXL2-4.0bpw-ref"]["engine"] == "exl2-reference"
    assert rows["EXL2-4.0bpw-ref"]["kld"] is not None and rows["EXL2-4.0bpw-ref"]["bpw"] > 4.0  # fp16 embeddings


@pytest.mark.parametrize(("flags", "message"), [
    (["--exl2", "4.0", "--exl2-backend", "cuda"], "unknown EXL2 backend"),
    (["--exl2", "4.0", "--exl2-head-bits", "7"], "head bits"),
    (["--exl2", "9.0"], "2.0..8.0"),
    (["--exl2", "4.0", "--exl2-backend", "exllamav2"], "ExLlamaV2 cannot run here"),
])
def test_bad_exl2_flags_are_refused_before_any_work(flags: list[str], message: str, demo_model: Path,
                                                    registry_path: Path, tmp_path: Path,
                                                    prefect_harness: None) -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests.conftest import registry_snapshot

    before = registry_snapshot(registry_path)
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--registry", str(registry_path), *flags],
                                env={"QUANTYARD_WORK_DIR": str(tmp_path / "work")})
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert registry_snapshot(registry_path) == before
