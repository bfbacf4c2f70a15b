"""Publishing: the dry run writes the exact commit operations and the model card; no network is used.
The demo card must render the metrics table from the registry's own results."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from gguf import GGUFReader
from huggingface_hub import ModelCard
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import Settings
from pipeline.errors import IllegalTransitionError, IntegrityError
from pipeline.llama_cpp import llama_cpp_toolchain
from registry import open_registry
from registry.publish import PublishRequest, publish
from registry.store import RegisterRequest
from tests.registry.helpers import SRC, flip_byte, request


def _tensors(reader: GGUFReader) -> dict[str, str]:
    return {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in reader.tensors}


def _fmt(x: float, nd: int) -> str:
    return f"{x:.{nd}f}"


def test_demo_dry_run_card_and_operations(tmp_path: Path, demo_registry: Path) -> None:
    out = tmp_path / "dry"
    result = CliRunner().invoke(app, ["publish", "demo/Q4_K_M", "demo/Q8_0", "demo/F16", "--repo", "acme/demo-GGUF",
                                      "--dry-run", "--out", str(out), "--split-mb", "8", "--base-model",
                                      "acme/demo", "--registry", str(demo_registry)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "operations.json").read_text())
    assert plan["repo_id"] == "acme/demo-GGUF" and plan["private"] is False
    ops = {o["path_in_repo"]: o for o in plan["operations"]}
    reg = open_registry(str(demo_registry))
    for variant in ("Q4_K_M", "Q8_0"):  # one GGUF per type at the root, byte-identical to the registry
        op = ops[f"demo-{variant}.gguf"]
        assert op["sha256"] == reg.get_version(f"demo/{variant}").files[0].sha256
        assert hashlib.sha256(Path(op["local_path"]).read_bytes()).hexdigest() == op["sha256"]
    parts = sorted(p for p in ops if p.startswith("F16/"))
    assert len(parts) >= 2 and parts[0].endswith(f"-00001-of-{len(parts):05d}.gguf")
    merged = tmp_path / "merged.gguf"
    tools = llama_cpp_toolchain(Settings(registry=str(demo_registry)))
    subprocess.run([str(tools.exe("llama-gguf-split")), "--merge", ops[parts[0]]["local_path"], str(merged)],
                   check=True, capture_output=True, env=tools.env())
    f16 = reg.get_version("demo/F16").files[0]
    original, joined = GGUFReader(reg.blobs.local_path(f16.sha256)), GGUFReader(merged)
    assert _tensors(joined) == _tensors(original)  # the split loses nothing: every tensor, byte for byte
    assert set(joined.fields) - set(original.fields) == {"split.count", "split.no", "split.tensors.count"}
    assert "README.md" in ops and any("validated" in w for w in plan["warnings"])

    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "acme/demo" and card.data.base_model_relation == "quantized"
    assert card.data.library_name == "gguf" and "quantyard" in card.data.tags
    text = card.text
    metrics = text.split("## Quality and speed")[1].split("## Lineage")[0]
    assert "| variant | bpw | PPL | ΔPPL % | KLD | top-1 % | pp tok/s | tg tok/s | engine |" in text
    for variant in ("Q4_K_M", "Q8_0", "F16"):
        view = reg.get_version(f"demo/{variant}")
        q = next(r for r in view.results if r.kind == "quality" and r.status == "ok")
        s = next(r for r in view.results if r.kind == "speed" and r.status == "ok")
        row = next(line for line in metrics.splitlines() if line.startswith(f"| {variant} |"))
        assert _fmt(q.metrics["ppl"], 4) in row and _fmt(q.metrics["kld_mean"], 6) in row
        assert _fmt(100 * q.metrics["top1_agreement"], 2) in row
        assert _fmt(s.metrics["decode_tok_per_s"]["median"], 1) in row
        assert f"{q.engine} {q.engine_version}" in row
        assert f"`{view.ref}` ({view.state})" in text  # lineage, per version
        assert f"Window set `{q.window_set_id}`" in text
    assert "local:sha256:" in text and "llama_cpp_python=" in text and "Reference: transformers" in text
    assert "No calibration data or importance matrix was used" in text
    floor = reg.list_source_artifacts(reg.get_version("demo/F16").source["identity"], "noise_floor")[0].meta
    assert f"- Noise floor (two unquantized runs differing only in arithmetic; a KLD within it cannot be told " \
        f"from the reference): KLD {floor['kld_mean']:.3g}" in text
    full = text.split("## The KL-divergence in full")[1]
    assert "| 99.9 % KLD |" in full and "| RMS Δp |" in full and "| same top p |" in full


def test_real_publish_needs_validated_versions(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    reg.register_version(request(tmp_path))
    with pytest.raises(IllegalTransitionError, match="validated"):
        publish(reg, PublishRequest(refs=["demo/Q8_0"], repo_id="acme/x"))  # refused before any network


def test_corrupt_blob_is_never_staged(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    view = reg.register_version(request(tmp_path))
    blob = reg.blobs.local_path(view.files[0].sha256)
    assert blob is not None
    flip_byte(blob)
    with pytest.raises(IntegrityError):
        publish(reg, PublishRequest(refs=["demo/Q8_0"], repo_id="acme/x", dry_run=True, out_dir=tmp_path / "o"))


def _dir_version(tmp: Path, fmt: str, variant: str, spec: dict[str, object]) -> RegisterRequest:
    folder = tmp / variant
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": fmt}}))
    (folder / "model.safetensors").write_bytes(variant.encode() * 100)
    return RegisterRequest(model="demo", source=SRC, variant=variant, format=fmt, spec=spec, build_key=variant,
                           lineage={"tool": {"name": fmt}}, files={p.name: p for p in folder.iterdir()})


def test_awq_and_exl2_layouts(tmp_path: Path, registry_path: Path) -> None:
    reg = open_registry(str(registry_path))
    reg.register_version(_dir_version(tmp_path, "awq", "AWQ-W4-G128-asym", {"bits": 4}))
    reg.register_version(_dir_version(tmp_path, "exl2", "EXL2-4.0bpw", {"bpw": 4.0}))
    reg.register_version(_dir_version(tmp_path, "exl2", "EXL2-6.5bpw", {"bpw": 6.5}))
    awq = publish(reg, PublishRequest(refs=["demo/AWQ-W4-G128-asym"], repo_id="acme/demo-AWQ", dry_run=True,
                                      out_dir=tmp_path / "awq"))
    assert {(o["revision"], o["path_in_repo"]) for o in awq.operations} == {
        (None, "config.json"), (None, "model.safetensors"), (None, "README.md")}
    exl2 = publish(reg, PublishRequest(refs=["demo/EXL2-4.0bpw", "demo/EXL2-6.5bpw"], repo_id="acme/demo-exl2",
                                       dry_run=True, out_dir=tmp_path / "exl2"))
    assert {(o["revision"], o["path_in_repo"]) for o in exl2.operations} == {
        ("4.0bpw", "config.json"), ("4.0bpw", "model.safetensors"), ("6.5bpw", "config.json"),
        ("6.5bpw", "model.safetensors"), (None, "README.md")}
    assert ModelCard.load(tmp_path / "exl2" / "README.md").data.library_name == "exllamav2"
