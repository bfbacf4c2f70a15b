"""GPU: llm-compressor AWQ on CUDA, then transformers reads the result on CUDA (the cross-check).

Run by scripts/gpu-check.sh on a lent GPU machine (no network there): a small random Llama is built
with the demo tokenizer (carried), quantized by the AWQ worker in this interpreter (the carried
llm-compressor wheels), and scored by the transformers runner on CUDA, source and AWQ on the same
windows. Results go to $OUT/awq-gpu.json. Skipped (not passed) on machines without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _tokenizer_dir() -> Path:
    given = os.environ.get("QUANTYARD_GPU_TOKENIZER")
    if given:
        return Path(given)
    from pipeline.config import Settings

    found = sorted((Settings().cache_dir / "demo").glob("*/tokenizer.json"))
    if not found:
        pytest.skip("no demo tokenizer: set QUANTYARD_GPU_TOKENIZER (scripts/gpu-check.sh does)")
    return found[0].parent


def _run(module: str, request: dict[str, object], path: Path) -> None:
    path.write_text(json.dumps(request))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    python = os.environ.get("QUANTYARD_AWQ_PYTHON", sys.executable)
    out = subprocess.run([python, "-m", module, str(path)], capture_output=True, text=True, env=env, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]


def test_llmcompressor_awq_on_cuda_and_transformers_reads_it(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run scripts/gpu-check.sh on a lent machine")
    from transformers import AutoTokenizer

    from evaluators.windows import build_window_set
    from tests.factories import random_checkpoint

    tok_dir = _tokenizer_dir()
    src = random_checkpoint(tmp_path / "src", tok_dir, hidden=256, intermediate=768, layers=2)
    text = (tok_dir / "calibration.txt").read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(str(src))(text, add_special_tokens=False)["input_ids"]
    calib = np.asarray([[1, *ids[i * 127:(i + 1) * 127]] for i in range(8)], dtype=np.int32)
    np.save(tmp_path / "calib.npy", calib)
    _run("converters.awq.workers.llmcompressor",
         {"model": str(src), "output": str(tmp_path / "awq"), "calibration": str(tmp_path / "calib.npy"), "bits": 4,
          "group_size": 128, "symmetric": False, "threads": 4, "result": str(tmp_path / "q.json")},
         tmp_path / "q-req.json")
    quant = json.loads((tmp_path / "q.json").read_text())
    assert quant["patch"].startswith("not applied")  # an accelerator is present
    qc = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"

    ws = build_window_set(src, text[len(text) // 2:], window=256, stride=256, max_windows=8)
    ws.save(tmp_path / "windows.npz")
    ppl = {}
    for name, model in (("source", src), ("awq", tmp_path / "awq")):
        out_dir = tmp_path / f"eval-{name}"
        _run("evaluators.transformers.runner",
             {"model": str(model), "windows": str(tmp_path / "windows.npz"), "ref_topk": None, "top_k": 8,
              "threads": 4, "dtype": "float32", "device": "cuda", "out_dir": str(out_dir)},
             tmp_path / f"{name}-req.json")
        with np.load(out_dir / "logprobs.npz") as z:
            ppl[name] = float(np.exp(-z["target_logprob"].mean()))
    result = {"quantize_s": quant["quantize_s"], "torch": quant["torch"], "ppl": ppl,
              "gpu": torch.cuda.get_device_name(0)}
    out = Path(os.environ.get("OUT", tmp_path))
    (out / "awq-gpu.json").write_text(json.dumps(result, indent=1))
    assert np.isfinite(ppl["awq"]) and abs(ppl["awq"] / ppl["source"] - 1) < 0.05, result
