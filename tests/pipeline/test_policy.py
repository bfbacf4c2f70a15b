"""The one quality check: QualityLimits.problems, used by validate and by a recipe's policy."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.policy import DEFAULT_CLASSES, DEFAULT_TYPES, PUBLISHED, Policy, QualityLimits, quant_class
from pipeline.results import KLD_EXACT as EXACT


def test_limits_pass_fail_and_never_pass_on_a_missing_metric() -> None:
    limits = QualityLimits(max_kld=0.05, max_delta_ppl_pct=5.0, min_top1=0.85)
    good = {"kld_mean": 0.04, "kld_method": EXACT, "delta_ppl_pct": 4.9, "top1_agreement": 0.9}
    assert limits.problems(good) == []
    bad = {"kld_mean": 0.06, "kld_method": EXACT, "delta_ppl_pct": 4.9, "top1_agreement": 0.8}
    assert limits.problems(bad) == ["kld_mean 0.06 > max_kld 0.05", "top1_agreement 0.8 < min_top1 0.85"]
    assert limits.problems({"kld_mean": 0.01, "kld_method": EXACT, "top1_agreement": 0.99}) == [
        "delta_ppl_pct missing (needed by max_delta_ppl_pct 5)"]
    assert QualityLimits(max_kld=0.05).problems({}) == ["kld_mean missing (needed by max_kld 0.05)"]
    assert QualityLimits().problems({}) == []  # no limit set: nothing to check


def test_every_class_a_spec_can_fall_in_has_default_limits() -> None:
    classes = {quant_class("gguf", {"type": t}) for t in ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_S",
                                                          "Q2_K", "IQ1_S", "TQ1_0", "MXFP4_MOE")}
    classes |= {quant_class("awq", {"bits": b}) for b in (4, 8)}
    classes |= {quant_class("exl2", {"bpw": b}) for b in (2.0, 3.0, 4.0, 5.0, 6.0, 8.0)}
    assert classes <= set(DEFAULT_CLASSES)


def test_a_cheaper_or_older_kld_never_passes_a_gate_on_the_exact_one() -> None:
    """A top-K lower bound (the cheaper mode), and a kld_mean stored before exact KLD (a top-32 bound), fail a
    max_kld gate however small they are, and the message says why."""
    limits = QualityLimits(max_kld=0.05)
    bound = {"kld_topk_lower_bound_mean": 0.001, "kld_method": "top32-lower-bound"}
    legacy = {"kld_mean": 0.001}
    for quality in (bound, legacy):
        (problem,) = limits.problems(quality)
        assert "exact full-vocabulary KLD" in problem and "0.001" in problem
    assert limits.problems({"kld_mean": 0.001, "kld_method": EXACT}) == []


def test_gate_lines_show_the_interval_and_say_when_it_straddles_the_limit() -> None:
    limits = QualityLimits(max_kld=0.05, max_delta_ppl_pct=5.0)
    q = {"kld_mean": 0.045, "kld_method": EXACT, "kld_ci95_low": 0.040, "kld_ci95_high": 0.052,
         "delta_ppl_pct": 2.0, "delta_ppl_pct_ci95_low": 1.5, "delta_ppl_pct_ci95_high": 2.6}
    kld, dppl = limits.lines(q)
    assert kld == "kld_mean 0.045 [95 % CI 0.04–0.052] ≤ 0.05: ok (inconclusive: the limit lies inside the interval)"
    assert dppl == "delta_ppl_pct 2 [95 % CI 1.5–2.6] ≤ 5: ok"


def test_the_kld_tail_is_gated_with_its_interval_and_only_on_the_exact_kld() -> None:
    """Limits on the exact KLD's 99th and 99.9th percentiles and maximum, and on RMS Δp: a pass, a failure, an
    inconclusive tail (its window-bootstrap interval holds the limit), and a top-K bound that has no tail."""
    limits = QualityLimits(max_kld_p99=0.3, max_kld_p999=0.8, max_kld_max=2.0, max_delta_p_rms=0.05)
    q = {"kld_mean": 0.05, "kld_method": EXACT, "kld_p99": 0.25, "kld_p99_ci95_low": 0.21, "kld_p99_ci95_high": 0.32,
         "kld_p999": 0.9, "kld_p999_ci95_low": 0.85, "kld_p999_ci95_high": 0.97, "kld_max": 1.5, "delta_p_rms": 0.04}
    assert limits.problems(q) == ["kld_p999 0.9 > max_kld_p999 0.8"]
    p99, p999, _, rms = limits.lines(q)
    assert p99 == ("kld_p99 0.25 [95 % CI 0.21–0.32] ≤ 0.3: ok (inconclusive: the limit lies inside the interval)")
    assert p999 == "kld_p999 0.9 [95 % CI 0.85–0.97] ≤ 0.8: FAIL" and rms == "delta_p_rms 0.04 ≤ 0.05: ok"
    bound = {"kld_topk_lower_bound_mean": 0.001, "kld_topk_lower_bound_p99": 0.01, "kld_method": "top32-lower-bound",
             "delta_p_rms": 0.01}
    problems = QualityLimits(max_kld_p99=0.3).problems(bound)
    assert len(problems) == 1 and problems[0].startswith("kld_p99 missing: this result has only a top32-lower-bound")


def test_any_printed_statistic_can_be_limited_and_a_misspelt_one_is_refused() -> None:
    limits = QualityLimits(max_stats={"kld_p95": 0.2}, min_stats={"delta_p_p01": -0.3})
    q = {"kld_mean": 0.05, "kld_method": EXACT, "kld_p95": 0.25, "delta_p_p01": -0.2}
    assert limits.problems(q) == ["kld_p95 0.25 > max_stats.kld_p95 0.2"]
    assert limits.lines(q) == ["kld_p95 0.25 ≤ 0.2: FAIL", "delta_p_p01 -0.2 ≥ -0.3: ok"]
    assert limits.problems({"kld_topk_lower_bound_mean": 0.01, "kld_method": "top32-lower-bound"})[0] \
        .startswith("kld_p95 missing: this result has only a top32-lower-bound")
    with pytest.raises(ValidationError, match=r"unknown statistic.*kld_p97"):
        QualityLimits(max_stats={"kld_p97": 0.1})


def test_default_limits_are_the_published_llama3_figures_with_a_margin() -> None:
    """1.25 × llama.cpp's LLaMA 3 8B scoreboard, rounded up to two digits: Q4_K_M 0.031273 → 0.04; a class
    takes its worst published type (Q4: q4_0 0.07194 → 0.09)."""
    assert DEFAULT_TYPES["Q4_K_M"].max_kld == 0.04 and DEFAULT_TYPES["Q8_0"].max_kld == 0.0017
    assert DEFAULT_CLASSES["Q4"].max_kld == 0.09
    for name, (kld, dppl) in PUBLISHED.items():
        assert kld * 1.25 <= DEFAULT_TYPES[name].max_kld < kld * 1.25 * 1.1, name
        assert dppl * 1.25 <= DEFAULT_TYPES[name].max_delta_ppl_pct < dppl * 1.25 * 1.1 + 0.01, name
    # more bits, tighter limits
    order = ["F16", "Q8", "Q6", "Q5", "Q4", "Q3", "Q2"]
    klds = [DEFAULT_CLASSES[c].max_kld for c in order]
    assert klds == sorted(klds)


@pytest.mark.parametrize(("variant", "cls", "qtype", "expected"), [
    ("Q4_K_M", "Q4", "Q4_K_M", 0.04), ("i1-IQ4_XS", "Q4", "IQ4_XS", 0.046), ("AWQ-W4-G128-asym", "Q4", None, 0.09)])
def test_limits_by_type_then_class(variant: str, cls: str, qtype: str | None, expected: float) -> None:
    assert Policy().limits_for(variant, cls, qtype).max_kld == expected
    assert Policy(overrides={variant: QualityLimits(max_kld=1.0)}).limits_for(variant, cls, qtype).max_kld == 1.0
