"""What a serving result shows (pipeline/serving_summary.py) and how the CLI shows it: ``quantyard show`` prints it
with its marks, ``quantyard compare`` never takes it for a quality or speed figure. SYNTHETIC serving results
(tests/labelled_serving.py) in a real SQLite registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.serving_summary import MemorySummary, gigabytes, profiles_note
from pipeline.shown import CPU_SCALED, DENSE_KERNEL
from tests.labelled_serving import MODEL, build_serving_registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("serving-cli")
    return build_serving_registry(base / "registry", base / "files")


def test_show_prints_a_serving_line_with_its_marks(registry: Path) -> None:
    result = CliRunner().invoke(app, ["show", f"{MODEL}/AWQ-W4-G128-asym", "--registry", str(registry)])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "result serving on vllm" in flat and "vllm serve SYNTHETIC¶§" in flat
    assert "cpu-scaled profile, 128 prompt / 64 output tokens" in flat
    assert "fits in 4.10 GB at context 4,096 with 64 users" in flat
    assert " ".join(CPU_SCALED.line.split()) in flat and " ".join(DENSE_KERNEL.line.split()) in flat
    shown = json.loads(CliRunner().invoke(app, ["show", f"{MODEL}/Q3_K_M", "--registry", str(registry),
                                               "--json"]).output)
    assert [r["kind"] for r in shown["results"]] == ["quality", "serving"]


def test_compare_takes_no_serving_result_for_speed(registry: Path) -> None:
    result = CliRunner().invoke(app, ["compare", MODEL, "--registry", str(registry), "--json"])
    rows = {r["variant"]: r for r in json.loads(result.output)}
    assert rows["Q4_K_M"]["pp_tok_s"] is None and rows["Q4_K_M"]["kld"] == 0.03
    assert rows["EXL2-4.0bpw"]["status"] == "candidate"


def test_memory_text_says_what_was_not_recorded() -> None:
    assert MemorySummary(peak_bytes=None, source=None, context=None, users=None).text == "peak memory not measured"
    m = MemorySummary(peak_bytes=5_000_000, source="device", context=None, users=1)
    assert m.text == "fits in 5.0 MB at a context not recorded with 1 user"
    assert m.what == "measured peak device memory (GPU)"
    assert gigabytes(8 * 10**9) == "8.00 GB" and profiles_note([]) is None


def test_the_replaced_kernel_is_read_from_either_flag() -> None:
    from pipeline.serving_summary import served_kernel

    assert served_kernel({"wna16_kernel_id": "dequantized", "wna16_kernel": "dense matmul"}) == "dense matmul"
    assert served_kernel({"wna16_kernel": "dequantized", "wna16_mode": "auto"}) == "dequantized"
    assert served_kernel({"wna16_kernel": "cpu_gemm_wna16"}) is None and served_kernel({}) is None
