"""The pre-flight's memory ESTIMATES (pipeline/footprint.py) against what real runs measured: an estimate decides
what is refused before any work, so it must not be below what the stage took. Here on the demo checkpoint's runs
(GGUF on llama.cpp; AWQ calibrated by llm-compressor, evaluated on vLLM and cross-checked by transformers); the
larger sizes' tables are bench/results/footprint_*.txt (bench/footprint.py)."""

from __future__ import annotations

import math
from pathlib import Path

from converters.checkpoint import load_checkpoint, read_facts
from flows.preflight import estimate_of
from pipeline.footprint import ModelFacts


def _checked(report: object) -> list[tuple[str, int, int]]:
    needs = report.preflight["needs"]  # type: ignore[attr-defined]
    out = []
    for stage in report.stages:  # type: ignore[attr-defined]
        usage = stage.get("usage") or {}
        est = estimate_of(stage["stage"], needs)
        if stage["status"] == "ran" and est is not None and usage.get("peak_process_bytes") is not None:
            out.append((stage["stage"], est, usage["peak_process_bytes"]))
    return out


def test_the_estimates_hold_the_gguf_run(demo_registry_template: dict[str, object]) -> None:
    checked = _checked(demo_registry_template["report"])
    assert {"prepare:gguf", "reference"} <= {s for s, _, _ in checked}
    assert any(s.startswith("build:") for s, _, _ in checked) and any(s.startswith("evaluate:") for s, _, _ in checked)
    low = [(s, e, m) for s, e, m in checked if e < m]
    assert not low, low


def test_the_estimates_hold_the_awq_run(awq_registry_template: dict[str, object]) -> None:
    checked = _checked(awq_registry_template["report"])
    stages = {s for s, _, _ in checked}
    assert any(s.startswith("build:AWQ") for s in stages) and any(s.endswith(":vllm") for s in stages), stages
    low = [(s, e, m) for s, e, m in checked if e < m]
    assert not low, low


def test_facts_come_from_the_headers_alone(demo_model: Path) -> None:
    fast = read_facts(demo_model)
    full = load_checkpoint(demo_model, scan_values=False).facts
    assert isinstance(fast, ModelFacts) and fast.n_params == full.n_params and fast.vocab == full.vocab
    assert fast.largest == max(math.prod(t.shape) for t in load_checkpoint(demo_model, scan_values=False)
                               .tensors.values())
