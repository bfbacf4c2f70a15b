"""The reference engine is a recorded choice (evaluators/reference.py): transformers on the checkpoint, or llama.cpp
on the unquantized GGUF, as ``llama-perplexity --kl-divergence-base`` uses.

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
from evaluators.reference import reference_identity, reference_key
from flows.quantize import convert_flow
from pipeline.cli.convert import EvalFlags, GGUFFlags, SourceFlags, VariantFlags, plan_from_options
from pipeline.errors import InvalidSpecError
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.plan import EvalSpec, Plan
from pipeline.results import ConvertReport
from registry import open_registry
from tests.conftest import make_settings

TYPES = ("Q8_0", "Q4_K_M", "Q2_K")
CHUNKS = 8

pytestmark = pytest.mark.slow


def _plan(demo: Path, engine: str) -> Plan:
    return plan_from_options(SourceFlags(source=str(demo), name="demo"), VariantFlags(gguf=",".join(TYPES)),
                             GGUFFlags(gguf_base="f16"),
                             EvalFlags(eval_text=demo / "eval.txt", score_from=257, max_windows=CHUNKS, no_speed=True,
                                       reference_engine=engine))


def _kld(report: ConvertReport) -> dict[str, float]:
    return {v.variant: float((v.quality or {})["kld_mean"]) for v in report.variants}


def test_reference_key_names_engine_dtype_and_versions() -> None:
    tf, lc = EvalSpec(), EvalSpec(reference_engine="llama.cpp", reference_dtype="float16")
    assert reference_identity("w", tf)["versions"].startswith("transformers ")
    assert (reference_identity("w", lc)["engine"], reference_identity("w", lc)["dtype"]) == ("llama.cpp", "float16")
    assert "llama-cpp-python" in reference_identity("w", lc)["versions"]
    keys = {reference_key("w", s) for s in (tf, lc, EvalSpec(reference_dtype="bfloat16"),
                                             EvalSpec(reference_engine="llama.cpp", reference_dtype="bfloat16"))}
    assert len(keys) == 4
    with pytest.raises(ValueError, match="unquantized GGUF, not 'int8'"):
        EvalSpec(reference_engine="llama.cpp", reference_dtype="int8")
    with pytest.raises(ValueError, match="this build's CPU, not cuda"):
        EvalSpec(reference_engine="llama.cpp", reference_dtype="float16", reference_device="cuda")
    with pytest.raises(InvalidSpecError, match="unknown reference engine 'vllm'"):  # the CLI's check, typed
        plan_from_options(SourceFlags(source="x"), VariantFlags(gguf="Q8_0"), GGUFFlags(),
                          EvalFlags(reference_engine="vllm"))


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
    theirs_tf = _kld(tf_ref)
    print("\nKLD by reference (demo, 8 windows, positions 257..511):")
    for t in TYPES:
        shift = ours[t] - theirs_tf[t]
        print(f"  {t:7s} llama.cpp F16 {ours[t]:.6g}  transformers fp32 {theirs_tf[t]:.6g}  "
              f"shift {shift:+.3g} ({100 * shift / theirs_tf[t]:+.2f} %)")
    # the reference's choice moves each type's KLD by far less than the step to the next type
    for lo, hi in itertools.pairwise(TYPES):
        gap = theirs_tf[hi] - theirs_tf[lo]
        assert gap > 0
        assert abs(ours[lo] - theirs_tf[lo]) < 0.1 * gap and abs(ours[hi] - theirs_tf[hi]) < 0.1 * gap
