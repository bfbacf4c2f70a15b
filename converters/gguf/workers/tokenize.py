"""Tokenize texts with a GGUF's own tokenizer (llama.cpp, vocabulary only). JSON request on stdin:

``{"model": path.gguf, "texts": {label: str}, "output": path.json}``; writes
``{label: {"ids": [...], "pieces": [...]}}`` to ``output``. Special tokens are added the way the GGUF's
metadata says (``add_bos_token`` ...), as the HF tokenizer adds them by default, and text that looks like
a special token is not parsed as one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    req = json.loads(sys.stdin.read())
    import llama_cpp

    model = llama_cpp.Llama(req["model"], vocab_only=True, verbose=False)
    piece: dict[int, str] = {}
    out = {}
    for label, text in req["texts"].items():
        ids = model.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        for i in set(ids) - piece.keys():
            piece[i] = model.detokenize([i], special=True).decode("utf-8", errors="replace")
        out[label] = {"ids": ids, "pieces": [piece[i] for i in ids]}
    Path(req["output"]).write_text(json.dumps(out), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
