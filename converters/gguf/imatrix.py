"""Importance matrices: ``llama-imatrix`` once per (source, base, calibration text, chunks, context).

The imatrix is computed on the unquantized base GGUF and cached next to it, so every imatrix quant
of a source (``i1-Q4_K_M``, ``i1-IQ4_XS``...) and every later run reuses it. The calibration text is
copied next to it under a content-addressed name and read from there (the imatrix file records the
dataset's name, so no local path leaks into it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converters.checkpoint import file_sha256
from converters.gguf.tokenizer import gguf_tokens
from pipeline.errors import ConfigError, ConversionError
from pipeline.fs import atomic_path, write_atomic
from pipeline.llama_cpp import LlamaCppToolchain
from pipeline.proc import run_logged


@dataclass(frozen=True)
class ImatrixRequest:
    """What to compute an importance matrix from.

    ``calibration`` is a UTF-8 text file; ``origin`` says where the text came from (``file:NAME``,
    ``checkpoint:calibration.txt``, ``builtin:...``); ``chunks`` of ``context`` tokens are evaluated
    (None: all the text holds). ``existing`` is an imatrix already stored for exactly this request
    (the registry's copy), used instead of recomputing.
    """

    calibration: Path
    origin: str
    chunks: int | None = None
    context: int = 512
    existing: Path | None = None

    @property
    def calibration_sha256(self) -> str:
        return file_sha256(self.calibration)

    def key(self, base_type: str, tool: dict[str, Any]) -> str:
        """Identity of the resulting imatrix (with the source, which the base folder already encodes)."""
        payload = {"calibration": self.calibration_sha256, "chunks": self.chunks, "context": self.context,
                   "base_type": base_type, "tool": tool}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def ensure_imatrix(base: Path, folder: Path, request: ImatrixRequest, key: str, *, toolchain: LlamaCppToolchain,
                   threads: int, timeout_s: float,
                   python: str = sys.executable, keep: Path | None = None) -> tuple[Path, dict[str, Any], bool]:
    """Return (imatrix path, its lineage record, whether it was computed now), computing it only if missing.

    Raises:
        ConfigError: the calibration text is too short for even two chunks of ``context`` tokens.
        ConversionError: llama-imatrix failed.
        ToolchainMissingError: llama-imatrix is not installed.
    """
    out = folder / f"imatrix-{key[:16]}.gguf"
    marker = folder / f"imatrix-{key[:16]}.json"
    if out.is_file() and marker.is_file():
        return out, dict(json.loads(marker.read_text())), False
    computed = request.existing is None
    if request.existing is not None:
        with atomic_path(out) as tmp:
            shutil.copyfile(request.existing, tmp)
    else:
        _run_imatrix(base, out, request, toolchain=toolchain, threads=threads, timeout_s=timeout_s,
                     python=python, keep=keep)
    meta = {**imatrix_record(out, request), "key": key}
    write_atomic(marker, json.dumps(meta))  # last: out and marker both there mean done
    return out, meta, computed


def _run_imatrix(base: Path, out: Path, request: ImatrixRequest, *, toolchain: LlamaCppToolchain,
                 threads: int, timeout_s: float, python: str, keep: Path | None) -> None:
    exe, env = toolchain.exe("llama-imatrix"), toolchain.env()
    folder = out.parent
    calib_name = f"calibration-{request.calibration_sha256[:16]}.txt"
    if not (folder / calib_name).is_file():
        shutil.copyfile(request.calibration, folder / calib_name)
    with atomic_path(out, suffix=".gguf") as tmp:  # llama-imatrix picks its output format by the suffix
        cmd = [str(exe), "-m", str(base), "-f", calib_name, "-o", tmp.name, "-c", str(request.context),
               "-t", str(threads), "--no-ppl"]
        if request.chunks is not None:
            cmd += ["--chunks", str(request.chunks)]
        res = run_logged(cmd, log_dir=folder, name="imatrix", timeout_s=timeout_s, env=env, cwd=folder, keep=keep)
        if not res.ok or not tmp.is_file():  # raising removes the partial output
            # llama-imatrix's log is asynchronous and can be lost when it exits early: count the tokens ourselves
            text = request.calibration.read_text(encoding="utf-8")
            n_tokens = len(gguf_tokens(base, python=python, env=env, log_dir=folder, timeout_s=timeout_s,
                                       text=text)[0])
            if n_tokens < 2 * request.context:
                raise ConfigError(
                    f"the calibration text ({request.origin}) is too short for an importance matrix: it is "
                    f"{n_tokens} tokens and llama-imatrix needs at least {2 * request.context} (two chunks of "
                    f"{request.context})", hint="pass a longer --calibration FILE")
            raise ConversionError(f"llama-imatrix {res.describe()} on {base.name}", stderr_tail=res.stderr_tail,
                                  hint=f"see the log {res.log}")


def imatrix_record(path: Path, request: ImatrixRequest) -> dict[str, Any]:
    """What lineage keeps about an imatrix: its digest and how it was made (chunks read from the file)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(name: str) -> Any:
        f = reader.get_field(name)
        return None if f is None else f.contents()

    return {"sha256": file_sha256(path), "size": path.stat().st_size, "tool": "llama-imatrix",
            "calibration_sha256": request.calibration_sha256, "calibration_origin": request.origin,
            "calibration_bytes": request.calibration.stat().st_size, "chunks_requested": request.chunks,
            "chunks": field("imatrix.chunk_count"), "context": field("imatrix.chunk_size") or request.context,
            "datasets": field("imatrix.datasets")}
