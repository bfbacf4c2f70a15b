"""The ExLlamaV2 engine on CUDA (marked ``gpu``; skipped with the reason elsewhere): it evaluates a
file exllamav2 converted and a file Quantyard's reference codec wrote, on the shared windows, and the
CPU reference evaluator agrees with it on the same windows."""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.exl2.converter import EXL2Converter
from evaluators.exl2_reference.evaluator import EXL2ReferenceEvaluator
from evaluators.exllamav2.evaluator import ExLlamaV2Evaluator
from evaluators.reference import run_reference
from evaluators.windows import build_window_set
from pipeline.config import Settings
from pipeline.plan import EvalSpec, SpeedSpec
from pipeline.specs import EXL2Backend, EXL2Spec
from tests.converters.test_exl2_gpu import _ctx
from tests.exl2_support import exl2_runtime, gpu_demo  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", [EXL2Backend.REFERENCE_CPU, EXL2Backend.EXLLAMAV2])
def test_exllamav2_evaluates_exl2_and_agrees_with_the_reference_engine(
        backend: EXL2Backend, exl2_runtime: Settings, gpu_demo: Path, tmp_path: Path) -> None:  # noqa: F811
    cfg = exl2_runtime
    conv = EXL2Converter(cfg)
    spec = EXL2Spec(bpw=4.0, backend=backend)
    ctx = _ctx(gpu_demo, cfg)
    built = conv.build(ctx, conv.prepare(ctx, [spec]), spec, tmp_path / "model")
    folder = next(iter(built.files.values())).parent
    ws = build_window_set(gpu_demo, (gpu_demo / "eval.txt").read_text(encoding="utf-8"), window=512, stride=512,
                          max_windows=16)
    windows = tmp_path / "windows.npz"
    ws.save(windows)
    spec_eval = EvalSpec(max_windows=16, reference_engine="transformers",
                         speed=SpeedSpec(repeats=2, gen_tokens=64, parallel=(1, 8), parallel_prompt_tokens=128,
                                         parallel_gen_tokens=32))
    ref, _ = run_reference(gpu_demo, windows, tmp_path / "ref", spec_eval, cfg)
    assert ref.arrays is not None
    real = ExLlamaV2Evaluator().evaluate(folder, windows=windows, window_set_id=ws.id, reference=ref.arrays,
                                         spec=spec_eval, out_dir=tmp_path / "exllamav2", settings=cfg)
    cpu = EXL2ReferenceEvaluator().evaluate(folder, windows=windows, window_set_id=ws.id, reference=ref.arrays,
                                            spec=spec_eval, out_dir=tmp_path / "reference", settings=cfg)
    assert real.engine == "exllamav2" and cpu.engine == "exl2-reference"
    assert real.quality is not None and cpu.quality is not None
    # same weights; ExLlamaV2 computes in fp16, the reference in fp32
    assert abs(real.quality["ppl"] / cpu.quality["ppl"] - 1) < 0.01, (real.quality["ppl"], cpu.quality["ppl"])
    assert real.quality["top1_agreement"] > 0.95
    speed = real.speed or {}
    assert speed["ttft_ms"]["median"] > 0 and speed["decode_tok_per_s"]["median"] > 0
    assert set(speed["parallel"]["by_parallel"]) == {"1", "8"}
    print(f"{backend}: exllamav2 PPL {real.quality['ppl']:.4f} KLD {real.quality['kld_mean']:.3e}; reference PPL "
          f"{cpu.quality['ppl']:.4f}; speed {speed}")
