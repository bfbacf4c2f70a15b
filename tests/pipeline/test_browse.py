"""``quantyard compare`` and ``show`` on a registry holding every kind of labelled number (tests/labelled.py):
the human table marks them, ``--json`` carries them unrounded with what they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.shown import CROSS_CHECK, DENSE_KERNEL, KLD_ESTIMATE, KLD_LOWER_BOUND
from tests.labelled import (
    AWQ_TRANSFORMERS_KLD,
    AWQ_VLLM_KLD,
    DENSE,
    DENSE_TG,
    EXACT_KLD,
    EXACT_PPL,
    LEGACY_KLD,
    REF1,
    WS1,
    WS2,
    build_labelled_registry,
)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("labelled")
    return build_labelled_registry(base / "registry", base / "files")


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _compare_json(registry: Path, model: str = "acme/labels") -> dict[str, dict[str, Any]]:
    rows = json.loads(_cli("compare", model, "--registry", str(registry), "--json"))
    assert len({r["variant"] for r in rows}) == len(rows)  # one row per variant: cross-checks are nested
    return {r["variant"]: r for r in rows}


def test_compare_json_is_unrounded_and_says_what_each_number_is(labelled: Path) -> None:
    rows = _compare_json(labelled)
    q8 = rows["Q8_0"]
    assert q8["kld"] == EXACT_KLD and q8["ppl"] == EXACT_PPL  # full precision (no 2e-06)
    assert (q8["kld_kind"], q8["kld_method"], q8["window_set_id"], q8["reference_key"]) == (
        "exact", "full-vocabulary", WS1, REF1)
    assert q8["ref_ppl"] == 196.8735 and q8["n_windows"] == 24 and q8["ci_method"].startswith("bootstrap")
    for key in ("ppl_ci95_low", "ppl_ci95_high", "delta_ppl_pct_ci95_low", "delta_ppl_pct_ci95_high",
                "kld_ci95_low", "kld_ci95_high"):
        assert isinstance(q8[key], float), key
    assert q8["delta_ppl_pct"] == pytest.approx(100 * (q8["ppl"] / q8["ref_ppl"] - 1), rel=1e-12)
    legacy = rows["Q4_K_M"]  # stored before exact KLD: its kld_mean was a top-K bound
    assert legacy["kld"] is None and legacy["kld_lower_bound"] == LEGACY_KLD and legacy["kld_kind"] == "lower_bound"
    assert KLD_LOWER_BOUND.key in legacy["marks"] and legacy["reference_key"] is None
    estimate = rows["AWQ-W8-legacy"]
    assert estimate["kld"] is None and estimate["kld_estimate"] == 3.3e-05 and KLD_ESTIMATE.key in estimate["marks"]


def test_compare_shows_the_formats_engine_and_the_cross_check_beside_it(labelled: Path) -> None:
    awq = _compare_json(labelled)["AWQ-W4-G128-asym"]
    # vLLM's result, although the transformers cross-check was stored after it
    assert (awq["engine"], awq["engine_role"], awq["kld"]) == ("vllm", "engine", AWQ_VLLM_KLD)
    (check,) = awq["cross_checks"]
    assert (check["engine"], check["role"], check["kld"]) == ("transformers", "cross-check", AWQ_TRANSFORMERS_KLD)
    assert awq["tg_tok_s"] == DENSE_TG and awq["speed_kernel"] == DENSE["wna16_kernel"]
    assert {CROSS_CHECK.key, DENSE_KERNEL.key} <= set(awq["marks"])
    rows = _compare_json(labelled)
    assert rows["AWQ-W4-G64-asym"]["engine_role"] == "stand-in"  # only transformers ran: labelled
    exl2 = rows["EXL2-4.0bpw-ref"]
    assert exl2["engine_role"] == "stand-in" and "stand-in:exl2:exl2-reference" in exl2["marks"]
    assert exl2["tg_tok_s"] is None


def test_compare_table_marks_stand_ins_bounds_and_the_dense_kernel(labelled: Path) -> None:
    out = _cli("compare", "acme/labels", "--registry", str(labelled))
    flat = " ".join(out.split())
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    assert "≥0.041†" in lines["Q4_K_M"] and "≈3.30e-05‡" in lines["AWQ-W8-legacy"]
    assert "1.23e-06" in lines["Q8_0"] and "†" not in lines["Q8_0"]  # exact: plain
    assert "exl2-reference*" in lines["EXL2-4.0bpw-ref"] and "transformers*" in lines["AWQ-W4-G64-asym"]
    assert "135.8§" in lines["AWQ-W4-G128-asym"] and "vllm " in lines["AWQ-W4-G128-asym"]
    assert "9.87e-04" in lines["└ cross-check"] and "transformers×" in lines["└ cross-check"]
    assert "stand-in (exl2-reference): dequantized EXL2 weights in fp32 transformers, not ExLlamaV2's kernels; " \
           "quality only, no speed" in flat
    assert "dense-matmul stand-in for vLLM's 4-bit kernel" in flat


def test_compare_notes_two_window_sets_and_names_them(labelled: Path) -> None:
    out = " ".join(_cli("compare", "acme/sets", "--registry", str(labelled)).split())
    assert "note: quality figures from 2 different window sets or references" in out
    assert f"window set {WS1[:12]}" in out and f"window set {WS2[:12]}" in out
    rows = _compare_json(labelled, "acme/sets")
    assert {r["window_set_id"] for r in rows.values()} == {WS1, WS2}


def test_show_labels_each_result_and_its_json_keeps_the_kind(labelled: Path) -> None:
    out = _cli("show", "acme/labels/AWQ-W4-G128-asym", "--registry", str(labelled))
    assert "result quality on vllm (vllm 1.0)" in out and "result quality on transformers× (" in out
    assert "tg 135.8§ tok/s" in out and "4-bit kernel: dequantized" in out and DENSE_KERNEL.line[:40] in out
    data = json.loads(_cli("show", "acme/labels/Q4_K_M", "--registry", str(labelled), "--json"))
    quality = next(r for r in data["results"] if r["kind"] == "quality")
    assert quality["kld_kind"] == "lower_bound" and quality["metrics"]["kld_mean"] == LEGACY_KLD
    exl2 = _cli("show", "acme/labels/EXL2-4.0bpw-ref", "--registry", str(labelled))
    assert "exl2-reference*" in exl2 and "not ExLlamaV2's kernels" in " ".join(exl2.split())


def test_show_prints_every_llama_perplexity_statistic(demo_registry: Path) -> None:
    """``show`` on a measured version: llama-perplexity's statistics, each from the stored result, and the KLD by
    the reference's confidence."""
    from registry import open_registry

    out = _cli("show", "demo/Q4_K_M", "--registry", str(demo_registry))
    metrics = next(r.metrics for r in open_registry(str(demo_registry)).get_version("demo/Q4_K_M").results
                   if r.kind == "quality" and r.status == "ok")
    for label, key in (("99.9 % KLD", "kld_p999"), ("minimum KLD", "kld_min"), ("median KLD", "kld_median")):
        line = next(x for x in out.splitlines() if f" {label} " in x)
        assert f"{metrics[key]:.6g}" in line, (label, line)
    rms = next(x for x in out.splitlines() if " RMS Δp " in x)
    assert f"{100 * metrics['delta_p_rms']:.6g} ± {100 * metrics['delta_p_rms_unc']:.3g} %" in rms
    assert "by the reference's confidence" in out and "0.8-1.0" in out


def test_compare_marks_what_is_within_the_noise_floor(demo_registry: Path) -> None:
    """``compare`` reads each row's reference's noise floor from the registry: F16 (the unquantized model on
    llama.cpp, as the floor's second run) is within it, Q2_K is not."""
    rows = {r["variant"]: r for r in json.loads(_cli("compare", "demo", "--registry", str(demo_registry), "--json"))}
    assert rows["F16"]["within_noise_floor"] and "noise-floor" in rows["F16"]["marks"]
    assert not rows["Q2_K"]["within_noise_floor"]
    table = _cli("compare", "demo", "--registry", str(demo_registry))
    assert "≃" in next(line for line in table.splitlines() if "F16" in line)
    assert "KLD p99" in table
