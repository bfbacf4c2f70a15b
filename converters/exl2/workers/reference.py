"""Quantyard's reference-cpu EXL2 backend as a worker (core interpreter: torch + transformers).

JSON request on stdin::

    {"model": dir, "measurement": dir, "threads": int, "result": path,
     "measure": {"text_file", "origin", "rows", "length"} | null,
     "jobs": [{"out": dir, "bpw": float, "head_bits": int, "result": path}, ...]}

With ``measure`` it first writes ``measurement.json`` and ``hessians.safetensors`` into
``measurement``; then it writes one EXL2 folder per job (model and Hessians loaded once), each job's
details to its ``result`` file once its folder is complete, and finally ``result`` (a missing file
means the worker failed at or before that point).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pipeline.fs import write_atomic


def _write(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1))


def main() -> int:
    req = json.loads(sys.stdin.read())
    import torch

    from converters.exl2.reference import measure, quantize

    torch.set_num_threads(int(req["threads"]))
    summary: dict[str, Any] = {}
    meas_dir = Path(req["measurement"])
    if req.get("measure"):
        m = req["measure"]
        doc = measure(Path(req["model"]), Path(m["text_file"]).read_text(encoding="utf-8"), m["origin"], meas_dir,
                      int(m["rows"]), int(m["length"]))
        summary.update({"calibration": doc["calibration"], "measure_s": doc["measure_s"], "layers": len(doc["layers"])})
    jobs = req.get("jobs") or []
    if jobs:
        for job, info in zip(jobs, quantize(Path(req["model"]), meas_dir, jobs), strict=True):
            _write(Path(job["result"]), info)
        summary["built"] = [job["out"] for job in jobs]
    _write(Path(req["result"]), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
