"""Format sanity of quantized artifacts, without loading them into an engine.

* GGUF: magic and version, every tensor's data inside the file, architecture and file type present,
  tokenizer model, tokens and (for BPE vocabularies) pre-tokenizer present, and shapes consistent
  with the hyper-parameters (embedding width, vocabulary size, block count).
* AWQ: ``quantization_config`` complete for compressed-tensors or legacy AutoAWQ checkpoints, and
  safetensors headers valid.
Each problem raises :class:`InvalidArtifactError` naming the file, what was expected and what was found.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NoReturn

from converters.checkpoint import read_safetensors_header
from pipeline.errors import InvalidArtifactError, InvalidCheckpointError

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


def awq_sanity(folder: Path) -> dict[str, Any]:
    """Check an AWQ checkpoint folder's quantization_config and safetensors headers."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        _fail(cfg_path, "config.json is missing", hint="an AWQ variant is a checkpoint folder with config.json")
    cfg = json.loads(cfg_path.read_text())
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        _fail(cfg_path, "quantization_config is missing", hint="re-export the AWQ checkpoint")
    method = qc.get("quant_method")
    required: tuple[str, ...]
    if method == "awq":
        required = ("bits", "group_size", "zero_point", "version")
    elif method == "compressed-tensors":
        required = ("format", "config_groups")
    else:
        _fail(cfg_path, f"quant_method is {method!r}, expected 'awq' or 'compressed-tensors'")
    missing = [k for k in required if k not in qc]
    if missing:
        _fail(cfg_path, f"quantization_config lacks {', '.join(missing)} (quant_method {method})",
              hint="re-export the checkpoint with its quantizer")
    if method == "compressed-tensors":
        for name, group in qc["config_groups"].items():
            w = (group or {}).get("weights") or {}
            gaps = [k for k in ("num_bits", "strategy") if k not in w]
            if gaps:
                _fail(cfg_path, f"config_groups.{name}.weights lacks {', '.join(gaps)}")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        _fail(folder, "no *.safetensors files")
    tensors = 0
    for shard in shards:
        try:
            tensors += len(read_safetensors_header(shard))
        except InvalidCheckpointError as exc:
            raise InvalidArtifactError(exc.message, hint=exc.hint) from exc
    return {"quant_method": method, "shards": len(shards), "tensors": tensors}
