"""AWQ with AutoAWQ 0.2.9 (legacy GEMM layout), run in the ``autoawq`` tool environment.

``python -m converters.awq.workers.autoawq REQUEST.json`` with the same request as
``awq_llmcompressor`` (``model``, ``output``, ``calibration`` npy of token ids, ``bits``,
``group_size``, ``symmetric``, ``threads``, ``seed``, ``result``). Writes ``quant_method: awq``,
``version: gemm`` with ``qweight``/``qzeros``/``scales`` tensors, for stacks that need that layout.
The calibration ids are passed as pre-tokenized samples, so AutoAWQ sees exactly the ids
llm-compressor sees.

Imports only the standard library, numpy and the tool's own stack.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

from converters.worker_protocol import read_request, write_result

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def quantize(req: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    torch.set_num_threads(int(req["threads"]))
    torch.manual_seed(int(req.get("seed", 0)))
    ids = np.load(req["calibration"]).astype(np.int64)
    model = AutoAWQForCausalLM.from_pretrained(req["model"], trust_remote_code=False, safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(req["model"], trust_remote_code=False)
    quant_config = {"zero_point": not bool(req["symmetric"]), "q_group_size": int(req["group_size"]),
                    "w_bit": int(req["bits"]), "version": "GEMM"}
    t0 = time.perf_counter()
    model.quantize(tokenizer, quant_config=quant_config, calib_data=ids.tolist(),
                   max_calib_samples=int(ids.shape[0]), max_calib_seq_len=int(ids.shape[1]))
    quant_s = time.perf_counter() - t0
    out = Path(req["output"])
    model.save_quantized(str(out), safetensors=True)
    tokenizer.save_pretrained(str(out))
    for name in TOKENIZER_FILES:  # keep the source's own tokenizer files byte for byte
        src = Path(req["model"]) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    return {"quantize_s": quant_s, "quant_config": quant_config, "n_samples": int(ids.shape[0]),
            "seq_len": int(ids.shape[1]), "torch": torch.__version__}


def main() -> int:
    req = read_request("converters.awq.workers.autoawq")
    write_result(req["result"], quantize(req))
    return 0


if __name__ == "__main__":
    sys.exit(main())
