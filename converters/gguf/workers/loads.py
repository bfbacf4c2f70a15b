"""Does llama.cpp load this GGUF? JSON request on stdin: ``{"model": path.gguf, "output": path.json}``, optionally
``"name"``: the file's name in messages (a file still being written has a temporary one).

Loads the file as llama.cpp's memory-fit pass does (``no_alloc``: every tensor is created and checked against
the hyperparameters, no weight is read), and writes ``{"loads": true}`` to ``output`` once it has. A file
llama.cpp refuses stops the worker with :class:`pipeline.llama_load.LlamaLoadError`, whose message is
llama.cpp's own reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.llama_load import check_loads


def main() -> int:
    req = json.loads(sys.stdin.read())
    import llama_cpp
    from llama_cpp import _internals

    llama_cpp.llama_backend_init()
    check_loads(llama_cpp, _internals, req["model"], name=req.get("name"))
    Path(req["output"]).write_text(json.dumps({"loads": True}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
