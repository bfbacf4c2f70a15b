"""Quantyard's reference-cpu EXL2 backend as a worker (core interpreter: torch + transformers).

JSON request on stdin: ``{"mode": "measure" | "quantize-<variant>", "threads": int, "result": path,
...}``; measure also takes ``model, text_file, origin, out, rows, length``, quantize takes
``model, measurement, out, bpw, head_bits``. The result (a JSON object) is written to ``result``
last; a missing result file means the worker failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    req = json.loads(sys.stdin.read())
    import torch

    from converters.exl2_reference import measure, quantize

    torch.set_num_threads(int(req["threads"]))
    if req["mode"] == "measure":
        doc = measure(Path(req["model"]), Path(req["text_file"]).read_text(encoding="utf-8"), req["origin"],
                      Path(req["out"]), int(req["rows"]), int(req["length"]))
        result = {"calibration": doc["calibration"], "measure_s": doc["measure_s"], "layers": len(doc["layers"])}
    else:
        result = quantize(Path(req["model"]), Path(req["measurement"]), Path(req["out"]), float(req["bpw"]),
                          int(req["head_bits"]))
    out = Path(req["result"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
