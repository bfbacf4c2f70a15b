"""vLLM evaluator: agreement with transformers on the same AWQ file, the runner's log-prob
reconstruction, the speed shape, and contained failures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from evaluators.runners.vllm import dense_rows
from evaluators.vllm import CPU_CAPS, GPU_SHAPE, VLLMEvaluator, speed_shape
from pipeline.config import Settings
from pipeline.errors import EngineError
from pipeline.plan import EvalSpec, SpeedSpec
from registry import open_registry
from tests.conftest import awq_eval_spec


def test_vllm_and_transformers_perplexity_of_the_same_awq_file_agree(
        awq_registry_template: dict[str, object]) -> None:
    view = open_registry(str(awq_registry_template["registry"])).get_version("demo/AWQ-W4-G128-asym")
    quality = {r.engine: r for r in view.results if r.kind == "quality" and r.status == "ok"}
    vllm, hf = quality["vllm"], quality["transformers"]
    assert vllm.window_set_id == hf.window_set_id
    assert vllm.metrics["n_tokens"] == hf.metrics["n_tokens"] > 1000
    assert abs(vllm.metrics["ppl"] / hf.metrics["ppl"] - 1) < 0.005, (vllm.metrics["ppl"], hf.metrics["ppl"])
    assert "compressed_tensors" in " ".join(hf.hardware["environment"]["pip_freeze"]).replace("-", "_")
    assert hf.engine_version.startswith("transformers 5.17")  # the awq environment's, not the core's 5.24


def test_dense_rows_keep_known_values_and_spread_the_rest() -> None:
    rng = np.random.default_rng(0)
    vocab = 50
    logits = rng.normal(size=vocab) * 3
    lp = logits - np.log(np.exp(logits).sum())
    top = np.argsort(-lp)[:8]
    target = np.array([int(np.argsort(-lp)[30])])
    ids, vals = np.concatenate([top, target]), np.concatenate([lp[top], lp[target]])
    (row,) = dense_rows(vocab, [(ids, vals)])
    assert np.allclose(row[ids], vals)  # everything vLLM reported is kept exactly
    assert np.isclose(np.exp(row).sum(), 1.0)  # a distribution
    unknown = np.setdiff1d(np.arange(vocab), ids)
    assert np.allclose(row[unknown], row[unknown][0]) and row[unknown][0] <= lp[top].min()
    (full,) = dense_rows(vocab, [(np.arange(vocab), lp)])  # the whole vocabulary: exact
    assert np.allclose(full, lp)


def test_speed_shape_gpu_is_the_seed_benchmark_cpu_is_capped() -> None:
    spec = EvalSpec(speed=SpeedSpec(prompt_tokens=512, gen_tokens=128))
    gpu = speed_shape(spec, "cuda")
    assert gpu is not None and {k: gpu[k] for k in GPU_SHAPE} == GPU_SHAPE and gpu["shape"].startswith("gpu")
    cpu = speed_shape(spec, "cpu")
    assert cpu is not None and all(cpu[k] <= CPU_CAPS[k] for k in CPU_CAPS) and "cpu-scaled" in cpu["shape"]
    assert speed_shape(EvalSpec(speed=SpeedSpec(enabled=False)), "cpu") is None


def test_broken_model_is_a_contained_engine_error(tmp_path: Path, awq_registry_template: dict[str, object]) -> None:
    reg = open_registry(str(awq_registry_template["registry"]))
    (windows,) = reg.list_source_artifacts(reg.get_version("demo/AWQ-W4-G128-asym").source["identity"],
                                           "window_set")
    (reference,) = reg.list_source_artifacts(reg.get_version("demo/AWQ-W4-G128-asym").source["identity"],
                                             "reference")
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "dtype": "float32"}))
    settings: Settings = awq_registry_template["settings"]  # type: ignore[assignment]
    with pytest.raises(EngineError) as err:
        VLLMEvaluator().evaluate(model, windows=reg.artifact_path(windows), window_set_id=windows.key,
                                 reference=reg.artifact_path(reference), spec=awq_eval_spec(speed=False),  # type: ignore[arg-type]
                                 out_dir=tmp_path / "eval", settings=settings)
    assert err.value.engine == "vllm" and err.value.returncode not in (0, None)
    assert err.value.stderr_tail  # the runner's own error is kept for the message
