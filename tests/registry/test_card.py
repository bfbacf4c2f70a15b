"""The model card's metrics table labels what the registry's tables label (tests/labelled.py): the format's
own engine first with a cross-check as a second row, stand-ins, KLD bounds and estimates, the dense-matmul
kernel stand-in's speed, and quality figures from different window sets or references."""

from __future__ import annotations

import pytest

from pipeline.shown import DENSE_KERNEL, KLD_ESTIMATE, KLD_LOWER_BOUND
from registry import open_registry
from registry.card import build_card
from tests.labelled import WS1, build_labelled_registry


@pytest.fixture(scope="module")
def card_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    base = tmp_path_factory.mktemp("card")
    reg = open_registry(str(build_labelled_registry(base / "registry", base / "files")))
    card = build_card(reg.latest_versions("acme/labels"), repo_id="acme/labels-quants", base_model="acme/base",
                      files=[], inputs=[], window_sets=[], references=[])
    return card.text.split("## Quality and speed")[1].split("## Lineage")[0]


def _line(text: str, variant: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {variant} |"))


def test_card_shows_vllm_and_the_transformers_cross_check_as_a_second_row(card_text: str) -> None:
    awq = _line(card_text, "AWQ-W4-G128-asym")
    assert "0.000152" in awq and awq.endswith("| vllm vllm 1.0 |")
    assert "135.8§" in awq and "5475.0§" in awq
    assert "| 0.000152§ |" in awq or "0.000152§" in awq  # quality from the dense-matmul kernel stand-in, marked
    check = _line(card_text, "AWQ-W4-G128-asym (cross-check)")
    assert "| 0.000987 |" in check and "transformers transformers 1.0×" in check


def test_card_marks_stand_ins_and_kld_kinds_with_a_legend(card_text: str) -> None:
    assert _line(card_text, "EXL2-4.0bpw-ref").endswith("exl2-reference exl2-reference 1.0\\* |")
    assert "| ≥0.040812† |" in _line(card_text, "Q4_K_M") and "| ≈0.000033‡ |" in _line(card_text, "AWQ-W8-legacy")
    assert "†" not in _line(card_text, "Q8_0") and "\\*" not in _line(card_text, "Q8_0")
    for line in (KLD_LOWER_BOUND.line, KLD_ESTIMATE.line, DENSE_KERNEL.line,
                 "\\* stand-in (exl2-reference): dequantized EXL2 weights in fp32 transformers, not ExLlamaV2's "
                 "kernels; quality only, no speed"):
        assert f"- {line}\n" in card_text, line
    assert "**Not comparable across sets:**" in card_text and f"window set {WS1[:12]}" in card_text
