"""Quantize a GGUF with llama.cpp. JSON request on stdin:

``{"input": base.gguf, "output": out.gguf, "ftype": int, "nthread": int, "imatrix": path|null,
"bin_dir": site-packages/bin}``

Without an imatrix this calls ``llama_cpp.llama_model_quantize`` (byte-identical to
``llama-quantize``). With one it runs the ``llama-quantize`` binary of the same build,
because the imatrix data structure is not reachable from the Python bindings. llama-quantize records the
imatrix's file name in the output (``quantize.imatrix.file``); it runs in the imatrix's folder and is given
the bare, content-addressed name, so that no path of this machine enters the bytes and a rebuild elsewhere
gives the same file.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path


def _ftype_name(ftype: int) -> str:
    import llama_cpp

    for name in dir(llama_cpp):
        if name.startswith("LLAMA_FTYPE_") and getattr(llama_cpp, name) == ftype and name != "LLAMA_FTYPE_GUESSED":
            return name.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
    raise SystemExit(f"llama.cpp has no file type {ftype}")


def main() -> int:
    req = json.loads(sys.stdin.read())
    if req.get("imatrix"):
        exe = Path(req["bin_dir"]) / "llama-quantize"
        # absolute(), not resolve(): a distributed build links the imatrix from the blob store under its
        # own name, and that name (not the blob's digest) is what the file must record
        imatrix = Path(req["imatrix"]).absolute()
        cmd = [str(exe), "--imatrix", imatrix.name, str(Path(req["input"]).absolute()),
               str(Path(req["output"]).absolute()), _ftype_name(req["ftype"]), str(req["nthread"])]
        return subprocess.run(cmd, cwd=imatrix.parent).returncode
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(req["ftype"])
    params.nthread = int(req["nthread"])
    rc = llama_cpp.llama_model_quantize(req["input"].encode(), req["output"].encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
