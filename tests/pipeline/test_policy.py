"""The one quality check: QualityLimits.problems, used by validate and by a recipe's policy."""

from __future__ import annotations

from pipeline.policy import DEFAULT_CLASSES, QualityLimits, quant_class


def test_limits_pass_fail_and_never_pass_on_a_missing_metric() -> None:
    limits = QualityLimits(max_kld=0.05, max_delta_ppl_pct=5.0, min_top1=0.85)
    good = {"kld_mean": 0.04, "delta_ppl_pct": 4.9, "top1_agreement": 0.9}
    assert limits.problems(good) == []
    bad = {"kld_mean": 0.06, "delta_ppl_pct": 4.9, "top1_agreement": 0.8}
    assert limits.problems(bad) == ["kld_mean 0.06 > max_kld 0.05", "top1_agreement 0.8 < min_top1 0.85"]
    assert limits.problems({"kld_mean": 0.01, "top1_agreement": 0.99}) == [
        "delta_ppl_pct missing (needed by max_delta_ppl_pct 5)"]
    assert QualityLimits(max_kld=0.05).problems({}) == ["kld_mean missing (needed by max_kld 0.05)"]
    assert QualityLimits().problems({}) == []  # no limit set: nothing to check


def test_every_class_a_spec_can_fall_in_has_default_limits() -> None:
    classes = {quant_class("gguf", {"type": t}) for t in ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_S",
                                                          "Q2_K", "IQ1_S", "TQ1_0", "MXFP4_MOE")}
    classes |= {quant_class("awq", {"bits": b}) for b in (4, 8)}
    classes |= {quant_class("exl2", {"bpw": b}) for b in (2.0, 3.0, 4.0, 5.0, 6.0, 8.0)}
    assert classes <= set(DEFAULT_CLASSES)
