"""Shared EXL2 test fixtures (imported by the EXL2 test modules).

* ``exl2_demo``: the real flow once per session on the demo checkpoint with ``--exl2 4.0,6.0,8.0``
  (reference-cpu backend, exl2-reference engine) and ``--gguf Q8_0`` in the same flow and table.
* ``exl2_runtime``: the ExLlamaV2 interpreter of a GPU machine (``QUANTYARD_EXL2_PYTHON``), or a skip
  saying why not — GPU tests never pass vacuously.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import Settings
from tests.conftest import make_settings, once_per_run

EXL2_BPWS = "4.0,6.0,8.0"


@pytest.fixture(scope="session")
def exl2_demo(tmp_path_factory: pytest.TempPathFactory, demo_model: Path, cache_dir: Path,
              prefect_harness: None) -> dict[str, Any]:
    # Each test module imports this fixture, so pytest holds one session fixture per module; the flow itself
    # runs once per test run (once_per_run: the memo of a single process, and the shared build of xdist workers).
    from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec, variants_from_flags
    from pipeline.results import ConvertReport

    plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo",
                variants=variants_from_flags(gguf="Q8_0", exl2=EXL2_BPWS),
                eval=EvalSpec(max_windows=8, speed=SpeedSpec(enabled=False)))

    def build(base: Path) -> dict[str, Any]:
        from flows.quantize import convert_flow

        report = convert_flow(plan, make_settings(base / "registry", base / "work", cache_dir))
        return {"base": str(base), "report": report.model_dump(mode="json")}

    got = once_per_run(tmp_path_factory, "exl2-demo", build)
    base = Path(got["base"])
    return {"settings": make_settings(base / "registry", base / "work", cache_dir),
            "report": ConvertReport.model_validate(got["report"]), "plan": plan}


def exl2_settings(base: Path, cache_dir: Path) -> Settings:
    """Settings pointing at this machine's ExLlamaV2 interpreter (the GPU check sets it)."""
    return make_settings(base / "registry", base / "work", cache_dir,
                         exl2_python=os.environ.get("QUANTYARD_EXL2_PYTHON"))


@pytest.fixture
def exl2_runtime(tmp_path: Path, cache_dir: Path) -> Settings:
    from pipeline import exl2_env

    cfg = exl2_settings(tmp_path, cache_dir)
    reason = exl2_env.unavailable_reason(cfg)
    if reason is not None:
        pytest.skip(f"needs ExLlamaV2 on CUDA ({reason}); run scripts/gpu-check-exl2.sh on a GPU machine")
    return cfg


@pytest.fixture
def gpu_demo(request: pytest.FixtureRequest) -> Path:
    """The demo checkpoint: a copy carried to the GPU machine (``QUANTYARD_DEMO_CHECKPOINT``), else the
    locally built one."""
    carried = os.environ.get("QUANTYARD_DEMO_CHECKPOINT")
    if carried:
        return Path(carried)
    return Path(request.getfixturevalue("demo_model"))
