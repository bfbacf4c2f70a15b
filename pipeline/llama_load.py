"""Loading a GGUF with llama-cpp-python and saying why llama.cpp refused it.

llama-cpp-python answers a file llama.cpp refuses with "Failed to load model from file" only. llama.cpp's loader
says why (a tensor's shape that does not fit the hyperparameters, an unknown architecture, a truncated file) in
its log, which llama-cpp-python silences. :func:`load_model` keeps the error-level lines of that log while it
loads and raises :class:`LlamaLoadError` with them.

Standard library only: the llama.cpp runner and the GGUF workers import it in the interpreter that has
llama-cpp-python, and the module itself never imports it (the caller passes the module in).
"""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path
from typing import Any

#: enum ggml_log_level (ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5; the comment in
#: llama-cpp-python's _logger.py still says ERROR is 3)
GGML_LOG_ERROR, GGML_LOG_CONT = 4, 5
#: enum llama_load_mode: read the file into buffers, no mmap (what ``no_alloc`` needs: llama.cpp asserts
#: ``!no_alloc`` on its mmap path)
LLAMA_LOAD_MODE_NONE = 0


class LlamaLoadError(RuntimeError):
    """llama.cpp refused to load a GGUF; the message carries llama.cpp's own reason."""


def load_model(lib: Any, internals: Any, path: str | Path, params: Any, *, name: str | None = None) -> Any:
    """``internals.LlamaModel`` of ``path`` with model ``params``; ``name`` is the file's name in messages
    (default: the path's).

    Raises:
        LlamaLoadError: llama.cpp refused the file; its loader's reason is the message (also written to stderr).
    """
    said: list[str] = []
    last = [0]

    @lib.llama_log_callback
    def keep(level: int, text: bytes, _user: Any) -> None:
        if level == GGML_LOG_ERROR or (level == GGML_LOG_CONT and last[0] == GGML_LOG_ERROR):
            said.append(text.decode("utf-8", errors="replace"))
        if level != GGML_LOG_CONT:
            last[0] = level

    lib.llama_log_set(keep, ctypes.c_void_p(0))
    try:
        return internals.LlamaModel(path_model=str(path), params=params, verbose=False)
    except ValueError as exc:
        text = "".join(said)
        sys.stderr.write(text)
        reasons = [" ".join(m.group(1).split()) for m in re.finditer(r"error loading model:\s*(.+)", text)]
        reason = reasons[-1] if reasons else (" ".join(text.split()) or "llama.cpp logged no reason")
        raise LlamaLoadError(f"llama.cpp cannot load {name or Path(path).name}: {reason}") from exc
    finally:
        default = sys.modules.get(f"{lib.__name__}._logger")  # llama-cpp-python's own callback, if it set one
        lib.llama_log_set(getattr(default, "llama_log_callback", None), ctypes.c_void_p(0))


def check_loads(lib: Any, internals: Any, path: str | Path, *, name: str | None = None) -> None:
    """Load ``path``'s metadata and tensor infos the way llama.cpp's memory-fit pass does (``no_alloc``: every
    tensor is created and checked against the hyperparameters, no weight is read): milliseconds for any size.

    Raises:
        LlamaLoadError: llama.cpp would refuse the file.
    """
    params = lib.llama_model_default_params()
    params.no_alloc = True
    params.load_mode = LLAMA_LOAD_MODE_NONE
    params.n_gpu_layers = 0
    load_model(lib, internals, path, params, name=name).close()
