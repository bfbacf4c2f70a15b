"""Every statistic ``llama-perplexity --kl-divergence`` prints, against Quantyard's, field by field, on the same GGUF
files and the same positions (the demo and the real checkpoint; the F16 base as llama.cpp's reference on both sides,
the second half of each 512-token chunk scored). The comparison and its allowances are bench/llama_fields.py's
(its docstring says how the allowance for llama-perplexity's 16-bit base is measured, not assumed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import make_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from llama_fields import check, run

pytestmark = pytest.mark.slow


def test_every_printed_field_agrees_on_the_demo(tmp_path: Path, demo_model: Path, cache_dir: Path,
                                               prefect_harness: None) -> None:
    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    assert check(run(demo_model, tmp_path, cfg, 8, "demo")) == []


def test_every_printed_field_agrees_on_the_real_checkpoint(tmp_path: Path, real_model: Path, cache_dir: Path,
                                                          prefect_harness: None) -> None:
    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    assert check(run(real_model, tmp_path, cfg, 4, "real")) == []


def test_the_comparison_catches_a_field_off_by_two_percent() -> None:
    """The allowances are what llama-perplexity's rounding measured on the F16 base, not a blanket tolerance."""
    f16_theirs = {"ppl": (20.0, 5e-7), "ref_ppl": (20.0, 5e-7), "ref_ppl_unc": (0.5, 5e-7),
                  "kld_mean": (2e-6, 5e-7), "kld_p99": (1e-5, 5e-7), "kld_min": (-1e-5, 5e-7)}
    f16_ours = {"ppl": 20.0, "ref_ppl": 20.0, "ref_ppl_unc": 0.5, "kld_mean": 1e-8, "kld_p99": 1e-7, "kld_min": 0.0}
    theirs = {"ppl": (21.0, 5e-7), "kld_mean": (0.05, 5e-7), "kld_p99": (0.4, 5e-7), "kld_min": (0.001, 5e-7)}
    good = {"ppl": 21.0, "kld_mean": 0.0502, "kld_p99": 0.401, "kld_min": 0.00101}
    assert check({"F16": (f16_ours, f16_theirs), "Q4_K_M": (good, theirs)}) == []
    bad = {**good, "kld_p99": 0.408}
    assert check({"F16": (f16_ours, f16_theirs), "Q4_K_M": (bad, theirs)}) == \
        ["Q4_K_M kld_p99: Quantyard 0.408, llama-perplexity 0.4 (allowed 0.00401)"]
