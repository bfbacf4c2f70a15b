"""GGUF file sanity, without loading the file into an engine: magic and version, every tensor's data inside
the file, architecture and file type present, tokenizer model, tokens and (for BPE vocabularies)
pre-tokenizer present, and shapes consistent with the hyper-parameters (embedding width, vocabulary size,
block count). Each problem raises :class:`InvalidArtifactError` naming the file, what was expected and what was found.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NoReturn

from pipeline.errors import InvalidArtifactError

GGUF_MAGIC = b"GGUF"


def _fail(path: Path, message: str, hint: str = "re-create the file; it is damaged or not a GGUF") -> NoReturn:
    raise InvalidArtifactError(f"{path.name}: {message}", hint=hint)


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    with path.open("rb") as fh:
        head = fh.read(8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        _fail(path, f"bad magic {head[:4]!r}, expected {GGUF_MAGIC!r}")
    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, OSError, KeyError) as exc:
        _fail(path, f"cannot parse the GGUF structure: the file is truncated or corrupt ({type(exc).__name__}: {exc})")
    raise AssertionError("unreachable")


def _field(reader: Any, name: str) -> Any:
    f = reader.get_field(name)
    return None if f is None else f.contents()


def gguf_structure(path: Path) -> Any:
    """Can this be read as GGUF at all? Magic, header, and every tensor's data inside the file.

    Returns the gguf-py reader. Raises InvalidArtifactError for a file that is not (or no longer) a GGUF.
    """
    size = path.stat().st_size
    reader = _reader(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            _fail(path, f"tensor {t.name} ends at byte {end} but the file has {size} bytes (truncated)",
                  hint="re-download or re-create the file")
    return reader


def gguf_sanity(path: Path, *, first_part: bool = True) -> dict[str, Any]:
    """Check one GGUF file (or one part of a split GGUF); returns a summary of what was checked."""
    reader = gguf_structure(path)
    summary: dict[str, Any] = {"tensors": len(reader.tensors), "size": path.stat().st_size}
    if not first_part:
        return summary
    arch = _field(reader, "general.architecture")
    if not arch:
        _fail(path, "general.architecture is missing")
    ftype = _field(reader, "general.file_type")
    if ftype is None:
        _fail(path, "general.file_type is missing")
    summary.update(architecture=arch, file_type=ftype)
    summary.update(_tokenizer_sanity(path, reader))
    summary.update(_shape_sanity(path, reader, str(arch), summary["n_vocab"]))
    return summary


def _tokenizer_sanity(path: Path, reader: Any) -> dict[str, Any]:
    model = _field(reader, "tokenizer.ggml.model")
    if not model:
        _fail(path, "tokenizer.ggml.model is missing: the file has no tokenizer",
              hint="convert again with llama.cpp's convert_hf_to_gguf.py from a checkpoint with its tokenizer")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else 0
    if n_vocab == 0:
        _fail(path, "tokenizer.ggml.tokens is missing or empty")
    pre = _field(reader, "tokenizer.ggml.pre")
    if model == "gpt2" and not pre:
        _fail(path, "BPE vocabulary without tokenizer.ggml.pre: llama.cpp would pre-tokenize it wrongly",
              hint="re-convert with a llama.cpp that recognises this pre-tokenizer")
    return {"tokenizer_model": model, "pre_tokenizer": pre, "n_vocab": n_vocab}


def _shape_sanity(path: Path, reader: Any, arch: str, n_vocab: int) -> dict[str, Any]:
    n_embd = _field(reader, f"{arch}.embedding_length")
    n_blocks = _field(reader, f"{arch}.block_count")
    by_name = {t.name: t for t in reader.tensors}
    emb = by_name.get("token_embd.weight")
    if emb is None:
        _fail(path, "tensor token_embd.weight is missing")
    shape = [int(d) for d in emb.shape]
    if n_embd is not None and shape[0] != int(n_embd):
        _fail(path, f"token_embd.weight has width {shape[0]}, {arch}.embedding_length says {n_embd}")
    if shape[1] != n_vocab:
        _fail(path, f"token_embd.weight has {shape[1]} rows but the tokenizer has {n_vocab} tokens")
    blocks = {int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    if n_blocks is not None and blocks != set(range(int(n_blocks))):
        _fail(path, f"{arch}.block_count is {n_blocks} but tensors exist for blocks "
                    f"{sorted(blocks)[:3]}…{sorted(blocks)[-3:] if blocks else []}")
    return {"n_embd": n_embd, "block_count": n_blocks}
