"""Quantize a GGUF with llama.cpp's ``llama-quantize``. JSON request on stdin:

``{"input": base.gguf, "output": out.gguf, "ftype": int, "nthread": int, "imatrix": path|null,
"bin_dir": site-packages/bin}``

It runs the ``llama-quantize`` binary of the installed llama-cpp-python build, with or without an imatrix: its
output is byte-identical to ``llama_cpp.llama_model_quantize`` (the same library call with the same default
parameters; tests/converters/test_gguf.py compares them), and this worker then starts in tens of milliseconds
instead of the third of a second ``import llama_cpp`` takes. The type is given as its number (llama-quantize
accepts a file type's number as well as its name), so no name table is needed here. llama-quantize records the
imatrix's file name in the output (``quantize.imatrix.file``); it runs in the imatrix's folder and is given the
bare, content-addressed name, so that no path of this machine enters the bytes and a rebuild elsewhere gives the
same file. Paths are absolute: llama-quantize reads a second argument that parses as a type as the type.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
# Looked up before the fork (as pipeline/proc.py does): the child only makes the call.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In llama-quantize, before exec: die with this worker, so a killed build leaves no quantizer writing
    (elsewhere the process group is still killed on a timeout)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def command(req: dict[str, object]) -> tuple[list[str], Path | None]:
    """The llama-quantize command line for ``req`` and the folder to run it in."""
    exe = Path(str(req["bin_dir"])) / "llama-quantize"
    args = [str(Path(str(req["input"])).absolute()), str(Path(str(req["output"])).absolute()),
            str(int(str(req["ftype"]))), str(int(str(req["nthread"])))]
    if not req.get("imatrix"):
        return [str(exe), *args], None
    # absolute(), not resolve(): a distributed build links the imatrix from the blob store under its
    # own name, and that name (not the blob's digest) is what the file must record
    imatrix = Path(str(req["imatrix"])).absolute()
    return [str(exe), "--imatrix", imatrix.name, *args], imatrix.parent


def main() -> int:
    cmd, cwd = command(json.loads(sys.stdin.read()))
    return subprocess.run(cmd, cwd=cwd, preexec_fn=_die_with_parent).returncode


if __name__ == "__main__":
    sys.exit(main())
