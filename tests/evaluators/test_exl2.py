"""EXL2 evaluation on CPU: the exl2-reference engine (the EXL2 folder dequantized into transformers by
the codec) and the choice between it and ExLlamaV2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from evaluators.engines import engine_for, get_evaluator
from evaluators.exl2_loader import load_exl2_as_hf
from pipeline.config import Settings
from pipeline.errors import EngineError
from pipeline.exl2_codec import dequantize, layer_prefixes, split_layer
from pipeline.plan import EvalSpec, SpeedSpec
from registry import open_registry
from tests.exl2_support import exl2_demo  # noqa: F401  (session fixture)


def test_without_exllamav2_the_reference_engine_stands_in_and_says_why(settings: Settings) -> None:
    engine, why = engine_for("exl2", settings)
    assert engine == "exl2-reference" and why is not None and "exllamav2" in why
    assert get_evaluator("exllamav2").unavailable_reason(settings) is not None
    assert get_evaluator("exl2-reference").unavailable_reason(settings) is None
    assert engine_for("gguf", settings) == ("llama.cpp", None)


def _folder(exl2_demo: dict[str, Any], variant: str, dest: Path) -> Path:  # noqa: F811
    reg = open_registry(exl2_demo["settings"].registry)
    reg.link_files(f"demo/{variant}", dest)
    return dest


def test_reference_loader_holds_exactly_the_dequantized_weights(exl2_demo: dict[str, Any],  # noqa: F811
                                                                tmp_path: Path, demo_model: Path) -> None:
    folder = _folder(exl2_demo, "EXL2-6.0bpw-ref", tmp_path / "m")
    model = load_exl2_as_hf(folder, dtype=torch.float32)
    tensors = load_file(str((folder / "output.safetensors").resolve()))
    params = dict(model.named_parameters())
    for prefix in layer_prefixes(list(tensors)):
        expected = dequantize(split_layer(tensors, prefix)).float()
        assert torch.equal(params[f"{prefix}.weight"].data, expected), prefix
    assert torch.equal(params["model.embed_tokens.weight"].data, tensors["model.embed_tokens.weight"].float())
    # and it is a faithful model: next-token predictions agree with the unquantized source almost always
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(str(demo_model), dtype=torch.float32).eval()
    ids = torch.arange(1, 129)[None] * 7 % 4000 + 5
    with torch.inference_mode():
        agree = (model(input_ids=ids).logits.argmax(-1) == source(input_ids=ids).logits.argmax(-1)).float().mean()
    assert agree > 0.9


def test_a_folder_that_is_not_exl2_fails_as_an_engine_error(exl2_demo: dict[str, Any], tmp_path: Path,  # noqa: F811
                                                            settings: Settings) -> None:
    cfg = exl2_demo["settings"]
    reg = open_registry(cfg.registry)
    (ws,) = reg.list_source_artifacts(exl2_demo["report"].source["identity"], "window_set")
    (ref,) = reg.list_source_artifacts(exl2_demo["report"].source["identity"], "reference")
    folder = tmp_path / "m"
    folder.mkdir()
    for f in _folder(exl2_demo, "EXL2-4.0bpw-ref", tmp_path / "linked").iterdir():
        shutil.copyfile(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="exl2-reference runner") as info:
        get_evaluator("exl2-reference").evaluate(
            folder, windows=reg.artifact_path(ws), window_set_id=ws.meta["id"], reference=reg.artifact_path(ref),
            spec=EvalSpec(max_windows=2, speed=SpeedSpec(enabled=False)), out_dir=tmp_path / "eval", settings=cfg)
    assert "expected 'exl2'" in info.value.stderr_tail


def test_results_are_labelled_exl2_reference_with_the_fallback_reason(exl2_demo: dict[str, Any]) -> None:  # noqa: F811
    reg = open_registry(exl2_demo["settings"].registry)
    (result,) = reg.get_version("demo/EXL2-4.0bpw-ref").results
    assert result.kind == "quality" and result.engine == "exl2-reference"
    assert "quantyard exl2 codec" in (result.engine_version or "")
    assert "stands in for exllamav2" in result.metrics["fallback"]
    assert not any(r.kind == "speed" for r in reg.get_version("demo/EXL2-4.0bpw-ref").results)


def test_an_output_head_over_a_vocabulary_not_a_multiple_of_32_is_evaluated(tmp_path: Path, demo_model: Path,
                                                                           settings: Settings,
                                                                           prefect_harness: None) -> None:
    """EXL2 pads a layer's output columns to a multiple of 32 and records no width: the reference loader took
    a Phi-3's lm_head over 4100 tokens as 4128 wide and the evaluation failed on the size mismatch. Phi-3 also
    fuses q/k/v and gate/up into one linear each."""
    from flows.quantize import convert_flow
    from pipeline.plan import Plan, SourceInput, variants_from_flags
    from tests.factories import arch_checkpoint

    ckpt = arch_checkpoint(tmp_path / "tiny-phi3", demo_model, "phi3", layers=1)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    assert vocab % 32
    plan = Plan(source=SourceInput(source=str(ckpt)), model_name="tiny-phi3", variants=variants_from_flags(exl2="4.0"),
                eval=EvalSpec(window=128, stride=128, max_windows=2, speed=SpeedSpec(enabled=False)))
    (variant,) = convert_flow(plan, settings).variants
    assert variant.status == "registered" and variant.eval_status == "ok", (variant.error, variant.eval_error)
    assert variant.engine == "exl2-reference" and variant.quality["top1_agreement"] > 0.5, variant.quality
    folder = tmp_path / "exl2"
    open_registry(settings.registry).link_files(f"tiny-phi3/{variant.variant}", folder)
    tensors = load_file(str((folder / "output.safetensors").resolve()))
    assert tensors["lm_head.q_weight"].shape[1] == vocab + (-vocab % 32)  # padded on disk
    head = load_exl2_as_hf(folder, dtype=torch.float32).lm_head.weight.data
    assert torch.equal(head, dequantize(split_layer(tensors, "lm_head"), vocab).float())
