"""Split GGUFs: ``llama-gguf-split --split-max-size`` and reading split files back.

A split GGUF is ``NAME-00001-of-0000N.gguf`` ... ``NAME-0000N-of-0000N.gguf``; llama.cpp is given the
first part and finds the others next to it by name. The registry keeps all parts as the files of one
version, under exactly those names.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from converters.gguf.header import GGUFHeader, read_header
from pipeline.errors import ConversionError
from pipeline.llama_cpp import LlamaCppToolchain
from pipeline.proc import run_logged

PART_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_gguf(path: Path, max_size: str, *, toolchain: LlamaCppToolchain, timeout_s: float,
               keep: Path | None = None) -> list[Path]:
    """Split ``path`` into parts of at most ``max_size`` (``500M``, ``2G``) next to it; remove ``path``.

    Returns the parts in order. Raises ConversionError (leaving no part behind) when the tool fails,
    ToolchainMissingError when it is not installed.
    """
    exe = toolchain.exe("llama-gguf-split")
    work = path.parent / f".split-{path.stem}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()  # llama-gguf-split does not create folders
    cmd = [str(exe), "--split", "--split-max-size", max_size, str(path), str(work / path.stem)]
    res = run_logged(cmd, log_dir=path.parent, name=f"split-{path.stem}", timeout_s=timeout_s, env=toolchain.env(),
                     keep=keep)
    parts = sorted(work.glob(f"{path.stem}-*-of-*.gguf"))
    if not res.ok or not parts:
        shutil.rmtree(work, ignore_errors=True)
        raise ConversionError(f"llama-gguf-split {res.describe()} on {path.name}", stderr_tail=res.stderr_tail,
                              hint=f"see the log {res.log}")
    moved = []
    for part in parts:
        dest = path.parent / part.name
        part.replace(dest)
        moved.append(dest)
    work.rmdir()
    path.unlink()
    return moved


def is_split_part(name: str) -> bool:
    return PART_RE.match(name) is not None


def first_part(paths: list[Path]) -> Path:
    """The file llama.cpp loads: the single GGUF, or part 00001 of a split one."""
    ggufs = sorted(p for p in paths if p.suffix == ".gguf")
    if not ggufs:
        raise ConversionError("no .gguf file among " + ", ".join(p.name for p in paths))
    return ggufs[0]


def inspect_parts(paths: list[Path]) -> dict[str, Any]:
    """Architecture, file type, tensor/parameter counts, size and bits per weight of a (split) GGUF.

    For split files the metadata is read from part 1 and the counts are summed over all parts, which
    must agree with the ``split.count`` and ``split.tensors.count`` part 1 declares. Only the headers are
    read (converters/gguf/header.py). Raises InvalidArtifactError for a truncated or corrupt part,
    ConversionError for parts that do not belong together.
    """
    return inspect_headers([read_header(p) for p in sorted(paths)])


def inspect_headers(headers: list[GGUFHeader]) -> dict[str, Any]:
    """:func:`inspect_parts` of headers already read, in part order."""
    first = headers[0]
    tensors = sum(len(h.tensors) for h in headers)
    n_elements = sum(h.n_elements for h in headers)
    size = sum(h.size for h in headers)
    declared_parts, declared_tensors = first.get("split.count"), first.get("split.tensors.count")
    if len(headers) > 1 and (declared_parts != len(headers) or declared_tensors != tensors):
        raise ConversionError(f"split GGUF {first.path.name} declares {declared_parts} parts and {declared_tensors} "
                              f"tensors, found {len(headers)} parts with {tensors} tensors",
                              hint="some parts are missing or belong to another file")
    return {"architecture": first.get("general.architecture"), "file_type": first.get("general.file_type"),
            "tensor_count": tensors, "n_elements": n_elements, "size": size, "parts": len(headers),
            "bpw": round(size * 8 / n_elements, 4) if n_elements else None}
