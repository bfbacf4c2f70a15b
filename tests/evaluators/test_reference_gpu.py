"""GPU: the reference on CUDA, as a 70 B source needs it: transformers on one GPU in bfloat16 and spread over every
visible GPU (``--reference-device auto``: accelerate's ``device_map="auto"``) in float32, and vLLM in bfloat16
where the vllm environment's CUDA build is installed. Each is compared, position by position over the whole
vocabulary, with transformers' float32 reference on the CPU on the same windows.

Run by scripts/gpu-check.sh (the awq section) on a lent GPU machine, on a small random Llama built with the demo
tokenizer. The vLLM CUDA wheel cannot travel to that machine, so the vLLM case skips there unless a vllm
interpreter is named (QUANTYARD_VLLM_PYTHON is refused by the reference: it runs in the managed environment
only). Skipped (not passed) on machines without CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.converters.test_awq_gpu import _tokenizer_dir

pytestmark = pytest.mark.gpu

#: Largest mean KL(fp32 CPU ‖ other) allowed: bfloat16 rounds every matmul input (about 3 significant digits);
#: float32 on a GPU differs from the CPU by kernel rounding (and TF32 matmuls, where torch allows them) only.
KLD_MAX = {"bfloat16": 1e-2, "float32": 1e-4}


def _arrays(out: Any) -> np.ndarray:
    """The whole stored distribution of a reference run, normalised log-probs float64 [N, V]."""
    from evaluators.protocol import decode_rows

    with np.load(out.arrays, allow_pickle=False) as z:
        a = decode_rows(z["full_codes"], z["full_lo"], z["full_step"]).astype(np.float64)
    return a - np.logaddexp.reduce(a, axis=1, keepdims=True)


def _kld(p: np.ndarray, q: np.ndarray) -> float:
    """Mean KL(P ‖ Q) over positions."""
    terms = np.where(np.isfinite(p), np.exp(p) * (p - q), 0.0)
    return float(terms.sum(axis=1).mean())


@dataclass(frozen=True)
class Setup:
    src: Path
    windows: Path
    settings: Any
    cpu: np.ndarray
    base: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run scripts/gpu-check.sh on a lent machine")
    from evaluators.reference import run_reference
    from evaluators.windows import build_window_set
    from pipeline.config import Settings
    from pipeline.plan import EvalSpec
    from tests.factories import random_checkpoint

    base = tmp_path_factory.mktemp("reference-gpu")
    tok_dir = _tokenizer_dir()
    src = random_checkpoint(base / "src", tok_dir, hidden=256, intermediate=768, layers=4)
    ws = build_window_set(src, (tok_dir / "calibration.txt").read_text(encoding="utf-8"), window=128, stride=128,
                          max_windows=8)
    ws.save(base / "windows.npz")
    settings = Settings(work_dir=base / "work", threads=4)
    cpu, _ = run_reference(src, base / "windows.npz", base / "cpu",
                           EvalSpec(window=128, reference_engine="transformers"), settings)
    return Setup(src, base / "windows.npz", settings, _arrays(cpu), base)


@pytest.mark.parametrize(("device", "dtype"), [("cuda", "bfloat16"), ("auto", "float32")])
def test_transformers_reference_on_gpus_agrees_with_the_cpu(setup: Setup, device: str, dtype: str) -> None:
    import torch

    from evaluators.reference import run_reference
    from pipeline.plan import EvalSpec

    spec = EvalSpec(window=128, reference_engine="transformers", reference_dtype=dtype, reference_device=device)
    out, summary = run_reference(setup.src, setup.windows, setup.base / device, spec, setup.settings)
    # device_map="auto" over every visible GPU, in their order (all of them, or fewer for a model this small)
    expected = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if device == "auto" else ["cuda:0"]
    assert summary["devices"] == expected or set(summary["devices"]) <= set(expected), summary["devices"]
    kld = _kld(setup.cpu, _arrays(out))
    print(f"\n{device} {dtype}: mean KL(cpu fp32 || gpu) = {kld:.3g} on {summary['devices']}")
    assert kld < KLD_MAX[dtype]


def test_vllm_reference_in_bfloat16_on_cuda_agrees_with_the_cpu(setup: Setup) -> None:
    from evaluators.reference import run_reference
    from pipeline import envs
    from pipeline.errors import ToolchainMissingError
    from pipeline.plan import EvalSpec

    try:
        envs.python_for("vllm", setup.settings)
    except ToolchainMissingError as exc:
        pytest.skip(f"no vLLM CUDA build here: {exc.message}")
    spec = EvalSpec(window=128, reference_engine="vllm", reference_dtype="bfloat16", reference_device="cuda")
    out, summary = run_reference(setup.src, setup.windows, setup.base / "vllm", spec, setup.settings)
    assert summary["capture_target_check_max_abs"] < 1e-2
    kld = _kld(setup.cpu, _arrays(out))
    print(f"\nvllm bfloat16 cuda: mean KL(cpu fp32 || vllm) = {kld:.3g}")
    assert kld < KLD_MAX["bfloat16"]
