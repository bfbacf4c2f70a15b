"""transformers runner: the unquantized reference (fp32 on CPU, bf16/fp16 on a GPU when asked),
and the cross-check engine for quantized checkpoints transformers can load (AWQ via
compressed-tensors). Extra request keys: ``dtype`` (float32|bfloat16|float16), ``device``
(cpu|cuda), ``batch_size``, and ``loader`` (``auto``, or ``exl2`` to dequantize an EXL2 folder
with Quantyard's reference codec first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evaluators.protocol import (
    Collector,
    Timer,
    hardware,
    load_windows,
    read_request,
    write_result,
)


def load_model(req: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, req.get("dtype", "float32"))
    if req.get("loader") == "exl2":
        from evaluators.exl2_loader import load_exl2_as_hf

        return load_exl2_as_hf(Path(req["model"]), dtype=dtype, device=req.get("device", "cpu"))
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=dtype, trust_remote_code=False)
    return model.to(req.get("device", "cpu")).eval()


def main() -> None:
    req = read_request()
    out_dir = Path(req["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    torch.set_num_threads(int(req["threads"]))
    model = load_model(req)
    ids, starts = load_windows(req["windows"])
    col = Collector.from_request(req)
    bs = int(req.get("batch_size", 4))
    device = req.get("device", "cpu")
    with Timer() as t, torch.inference_mode():
        for b in range(0, ids.shape[0], bs):
            batch = torch.as_tensor(ids[b:b + bs], device=device)
            logits = model(input_ids=batch).logits.float().cpu().numpy()
            for j in range(batch.shape[0]):
                col.add_window(logits[j], ids[b + j], int(starts[b + j]))
    n = col.save(out_dir)
    version = f"transformers {transformers.__version__}, torch {torch.__version__}, {req.get('dtype', 'float32')}"
    write_result(out_dir, {
        "engine": "transformers" if req.get("loader") != "exl2" else "exl2-reference",
        "engine_version": version,
        "hardware": hardware(int(req["threads"])),
        "quality": {"n_positions": n, "eval_s": t.s, "eval_tok_per_s": ids.size / t.s,
                    "dtype": req.get("dtype", "float32")},
    })


if __name__ == "__main__":
    main()
