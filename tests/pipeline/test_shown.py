"""pipeline/shown.py: which result a row shows, how a number that is not what its header says is marked,
and the human table that prints them (pipeline/render.py)."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from pipeline.render import results_table
from pipeline.results import CrossCheck, EvalResult, VariantOutcome
from pipeline.shown import (
    CROSS_CHECK,
    DENSE_KERNEL,
    KLD_ESTIMATE,
    KLD_LOWER_BOUND,
    eval_sets_note,
    kld_text,
    legend,
    mark_of,
    pick,
    quality_fields,
    role_of,
    shown_kld,
    table_rows,
)
from tests.labelled import DENSE, EXACT_KLD, EXACT_PPL, LEGACY_KLD, REF1, REF2, WS1, WS2, exact


def _q(engine: str, kld: float, **extra: Any) -> EvalResult:
    return EvalResult(kind="quality", engine=engine, window_set_id=WS1, metrics={**exact(197.0, kld, 0.97), **extra})


def test_the_formats_own_engine_is_shown_and_a_newer_cross_check_rides_beside_it() -> None:
    results = [_q("vllm", 1e-4), EvalResult(kind="speed", engine="vllm", metrics={"decode_tok_per_s": 5.0}),
               _q("transformers", 9e-4)]  # the cross-check is the newest result
    picked = pick("awq", results)
    assert picked.quality is results[0] and picked.speed is results[1]
    assert [(role, r.engine) for role, r in picked.others] == [("cross-check", "transformers")]


def test_a_fallback_is_shown_only_without_the_engine_and_then_as_a_stand_in() -> None:
    only = [_q("transformers", 9e-4)]
    assert pick("awq", only).quality is only[0] and role_of("awq", "transformers") == "stand-in"
    ref = _q("exl2-reference", 2e-6)
    assert pick("exl2", [ref]).quality is ref and role_of("exl2", "exl2-reference") == "stand-in"
    real = _q("exllamav2", 3e-6)
    picked = pick("exl2", [real, ref])  # the engine's result wins even when the stand-in's is newer
    assert picked.quality is real and [(role, r.engine) for role, r in picked.others] == [
        ("stand-in", "exl2-reference")]
    newer = _q("llama.cpp", 5e-5)
    assert pick("gguf", [_q("llama.cpp", 1e-5), newer]).quality is newer  # same engine: the newest
    assert pick("future-format", [_q("a", 1.0), _q("b", 2.0)]).quality.engine == "b"  # type: ignore[union-attr]


def test_failed_results_are_never_shown() -> None:
    failed = EvalResult(kind="quality", engine="vllm", status="failed", error="EngineError")
    stand_in = _q("transformers", 9e-4)
    assert pick("awq", [stand_in, failed]).quality is stand_in


@pytest.mark.parametrize(("metrics", "kind", "key"), [
    (exact(197.0, EXACT_KLD, 0.97), "exact", "kld"),
    ({"kld_mean": LEGACY_KLD}, "lower_bound", "kld_lower_bound"),  # stored before exact KLD
    ({"kld_topk_lower_bound_mean": LEGACY_KLD, "kld_method": "top32-lower-bound"}, "lower_bound", "kld_lower_bound"),
    ({"kld_mean": LEGACY_KLD, "at_ref_known_fraction": 0.97}, "estimate", "kld_estimate"),  # vLLM's old spreading
])
def test_kld_is_only_ever_the_exact_value(metrics: dict[str, Any], kind: str, key: str) -> None:
    fields = quality_fields(metrics)
    assert fields["kld_kind"] == kind and fields[key] == metrics.get("kld_mean", metrics.get(
        "kld_topk_lower_bound_mean"))
    others = {"kld", "kld_lower_bound", "kld_estimate"} - {key}
    assert all(fields[k] is None for k in others)
    assert shown_kld(fields).kind == kind


def test_kld_text_marks_bounds_and_estimates_and_leaves_exact_values_plain() -> None:
    def fmt(x: float) -> str:
        return f"{x:.4f}"

    assert kld_text(shown_kld(quality_fields(exact(197.0, 0.0408, 0.9))), fmt) == "0.0408"
    assert kld_text(shown_kld(quality_fields({"kld_mean": 0.0408})), fmt) == "≥0.0408" + KLD_LOWER_BOUND.symbol
    assert kld_text(shown_kld(quality_fields({"kld_mean": 0.0408, "at_ref_known_fraction": 0.5})), fmt) == \
        "≈0.0408" + KLD_ESTIMATE.symbol
    assert kld_text(shown_kld({}), fmt) == ""


def test_eval_sets_note_names_every_set_and_its_rows() -> None:
    assert eval_sets_note([("A", WS1, REF1), ("B", WS1, REF1)]) is None
    note = eval_sets_note([("A", WS1, REF1), ("B", WS1, REF1), ("C", WS2, REF2)])
    assert note is not None and "2 different" in note
    assert f"window set {WS1[:12]}, reference {REF1[:12]}: A, B" in note
    assert f"window set {WS2[:12]}, reference {REF2[:12]}: C" in note
    legacy = eval_sets_note([("A", WS1, REF1), ("old", WS1, None)])  # no reference_key: not known to be the same
    assert legacy is not None and "reference not recorded: old" in legacy


def _awq_outcome() -> VariantOutcome:
    return VariantOutcome(
        variant="AWQ", format="awq", status="registered", size=4_400_000, bpw=4.5,
        quality={**exact(EXACT_PPL, EXACT_KLD, 0.9859), **DENSE}, engine="vllm", window_set_id=WS1,
        speed={"prompt_tok_per_s": {"median": 5475.25}, "decode_tok_per_s": {"median": 135.8}, **DENSE},
        cross_checks=[CrossCheck(engine="transformers", window_set_id=WS1, quality=exact(197.5, 9.87e-4, 0.97))])


def test_table_rows_are_unrounded_and_carry_what_checks_delta_ppl() -> None:
    (row,) = table_rows([_awq_outcome()])
    assert row["kld"] == EXACT_KLD and row["ppl"] == EXACT_PPL and row["pp_tok_s"] == 5475.25  # no rounding
    assert row["size_mb"] == 4.4 and row["ref_ppl"] == 196.8735 and row["reference_key"] == REF1
    assert row["window_set_id"] == WS1 and row["kld_method"] == "full-vocabulary" and row["kld_kind"] == "exact"
    assert row["delta_ppl_pct"] == pytest.approx(100 * (row["ppl"] / row["ref_ppl"] - 1), rel=1e-12)
    assert row["delta_ppl_pct_ci95_low"] == -0.01 and row["ppl_ci95_high"] == EXACT_PPL * 1.01
    assert row["speed_kernel"] == DENSE["wna16_kernel"] == row["quality_kernel"] and row["engine_role"] == "engine"
    (check,) = row["cross_checks"]
    assert (check["engine"], check["role"], check["kld"]) == ("transformers", "cross-check", 9.87e-4)
    assert set(row["marks"]) == {DENSE_KERNEL.key, CROSS_CHECK.key}


def _render(rows: list[dict[str, Any]]) -> str:
    console = Console(width=200, record=True)
    console.print(results_table("t", rows))
    return console.export_text()


def test_the_human_table_marks_and_explains_every_labelled_number() -> None:
    legacy = VariantOutcome(variant="Q4_K_M", format="gguf", engine="llama.cpp",
                            quality={"ppl": 197.2, "kld_mean": LEGACY_KLD, "top1_agreement": 0.97})
    stand_in = VariantOutcome(variant="EXL2-ref", format="exl2", engine="exl2-reference",
                              quality=exact(196.9, 2e-6, 0.99), window_set_id=WS1)
    text = _render(table_rows([_awq_outcome(), legacy, stand_in]))
    assert "≥0.041†" in text and "0.041 " not in text.replace("≥0.041†", "")  # the bound never shows bare
    assert "1.23e-06" in text and "exl2-reference*" in text and "135.8§" in text and "5,475§" in text
    assert "1.23e-06§" in text  # vLLM's quality figures, computed with the dense-matmul kernel stand-in
    assert "└ cross-check" in text and "transformers×" in text
    for mark in (KLD_LOWER_BOUND, DENSE_KERNEL, CROSS_CHECK, mark_of("stand-in:exl2:exl2-reference")):
        assert mark.line[:60] in " ".join(text.split()), mark.key
    assert "dequantized EXL2 weights in fp32 transformers, not ExLlamaV2's kernels; quality only, no speed" in \
        " ".join(text.split())
    assert "note:" in text  # the legacy row has no reference_key: a set of its own


def test_a_table_of_exact_rows_on_one_set_has_no_legend_and_no_note() -> None:
    rows = table_rows([VariantOutcome(variant=v, format="gguf", engine="llama.cpp", window_set_id=WS1,
                                      quality=exact(197.0, 1e-3, 0.97)) for v in ("A", "B")])
    text = _render(rows)
    assert all(r["marks"] == [] for r in rows) and "note:" not in text and "†" not in text and "*" not in text
    assert legend([]) == []
