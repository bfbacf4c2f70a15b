"""transformers runner: the unquantized reference (fp32 on CPU, bf16/fp16 on a GPU when asked),
and the cross-check engine for quantized checkpoints transformers can load (AWQ via
compressed-tensors). Extra request keys: ``dtype`` (float32|bfloat16|float16), ``device``
(cpu | cuda | cuda:N | auto: the model spread over every visible GPU by accelerate's ``device_map="auto"``),
``batch_size``, and ``loader`` (``auto``, or ``exl2`` to dequantize an EXL2 folder with Quantyard's reference
codec first). A GPU device where torch sees none is an error that says so, never a silent CPU run; the result
records the devices the weights were placed on (``quality.devices``).

On the CPU the runner asks MKL for results that do not depend on the number of threads
(``MKL_CBWR=AUTO,STRICT``, set before torch loads unless the caller set ``MKL_CBWR``, and recorded as
``quality.mkl_cbwr``). Without it, MKL's AVX2 code path on Intel (an AVX2-only Intel CPU's) gave other logits at
1, 2, 3 and 4 threads (measured: up to 4.8e-7 apart in an attention block), so a KLD near zero moved with
``--threads``; MKL's AVX-512 path on Intel gave the same bits either way, and the same bits as STRICT. On an AMD
EPYC with AVX-512 (2026-12-06) MKL ran its path for non-Intel processors whatever MKL_ENABLE_INSTRUCTIONS said, and
gave the same bits at 1 and 2 threads with and without STRICT (bench/results/mkl_thread_invariance_amd_2026-12-06.txt).
MKL documents its strict mode for Intel CPUs; on another vendor the test of it
(tests/evaluators/test_transformers_runner.py) reports a difference as xfail.
Cost measured on SmolLM2-135M, 8x512 tokens, 2 threads: none beyond noise on AVX-512, about 3 % on the AVX2 path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evaluators.protocol import (
    Collector,
    Timer,
    hardware,
    load_windows,
    read_request,
    report_progress,
    write_result,
)

#: MKL's conditional numerical reproducibility: the best code path this CPU has, bitwise the same at any
#: number of threads (see the module's docstring).
MKL_CBWR = "AUTO,STRICT"


def load_model(req: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, req.get("dtype", "float32"))
    device = str(req.get("device", "cpu"))
    if device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"the model was asked to run on {device}, but torch {torch.__version__} sees no CUDA GPU "
                         "(torch.cuda.is_available() is False): use device cpu (--reference-device cpu), or run "
                         "this step on a GPU worker")
    if req.get("loader") == "exl2":
        from evaluators.exl2_loader import load_exl2_as_hf

        return load_exl2_as_hf(Path(req["model"]), dtype=dtype, device=device)
    if device == "auto":  # every visible GPU, layer by layer (accelerate); inputs go to the embedding's device
        return AutoModelForCausalLM.from_pretrained(req["model"], dtype=dtype, trust_remote_code=False,
                                                    device_map="auto").eval()
    model: Any = AutoModelForCausalLM.from_pretrained(req["model"], dtype=dtype, trust_remote_code=False)
    return model.to(device).eval()


def device_name(where: Any) -> str:
    """One device as torch names it: ``cuda:N``, ``cpu``, ``disk``. accelerate's ``hf_device_map`` gives a GPU as its
    bare index (``0``, or ``"0"``), a parameter's ``.device`` as ``cuda:0``; both are recorded as ``cuda:0``."""
    text = str(where)
    return f"cuda:{text}" if text.isdigit() else text


def placement(model: Any) -> list[str]:
    """The devices the model's weights are on, in order of first use (``hf_device_map`` under device_map: on one
    GPU, transformers 5.17 leaves it unset, so both paths must name devices alike; checked on an H200)."""
    where = getattr(model, "hf_device_map", None)
    devices = [device_name(d) for d in where.values()] if where else [device_name(p.device)
                                                                      for p in model.parameters()]
    return list(dict.fromkeys(devices))


def main() -> None:
    req = read_request()
    out_dir = Path(req["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MKL_CBWR", MKL_CBWR)  # read by MKL when torch loads it, so before the import
    import torch
    import transformers

    torch.set_num_threads(int(req["threads"]))
    model = load_model(req)
    ids, starts = load_windows(req["windows"])
    col = Collector.from_request(req)
    bs = int(req.get("batch_size", 4))
    device = model.get_input_embeddings().weight.device
    with Timer() as t, torch.inference_mode():
        for b in range(0, ids.shape[0], bs):
            batch = torch.as_tensor(ids[b:b + bs], device=device)
            logits = model(input_ids=batch).logits.float().cpu().numpy()
            for j in range(batch.shape[0]):
                col.add_window(logits[j], ids[b + j], int(starts[b + j]))
            done = min(ids.shape[0], b + bs)
            report_progress("windows", done, ids.shape[0], done * ids.shape[1])
    n = col.save(out_dir)
    version = f"transformers {transformers.__version__}, torch {torch.__version__}, {req.get('dtype', 'float32')}"
    write_result(out_dir, {
        "engine": "transformers" if req.get("loader") != "exl2" else "exl2-reference",
        "engine_version": version,
        "hardware": hardware(int(req["threads"])),
        "quality": {"n_positions": n, "eval_s": t.s, "eval_tok_per_s": ids.size / t.s,
                    "dtype": req.get("dtype", "float32"), "devices": placement(model),
                    "mkl_cbwr": os.environ["MKL_CBWR"]},
    })


if __name__ == "__main__":
    main()
