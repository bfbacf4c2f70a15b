"""A GGUF file's header read fast: the key/values and tensor infos, without the vocabulary.

gguf-py's ``GGUFReader`` turns every entry of every array (a 49k-token vocabulary: three arrays of 49k
entries) into numpy views, which takes about 4 s at 49k tokens and 13 s at 262k. A build only needs the
scalar metadata (architecture, file type, split counts), the tensor infos and a digest of the tokenizer
metadata, so :func:`read_header` walks the arrays without materializing them: fixed-size ones by size
arithmetic, string arrays by their length prefixes (tens of milliseconds at 262k). The value and tensor types
and their sizes come from gguf-py (``GGUFValueType``, ``GGML_QUANT_SIZES``); tests/converters/test_gguf_header.py
checks the result against ``GGUFReader`` on the demo and the real checkpoint's files.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from pipeline.errors import InvalidArtifactError

#: struct codes of GGUF's scalar value types, by ``GGUFValueType`` value (the layout GGUF defines)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
TOKENIZER_PREFIX = "tokenizer."


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's info: ``shape`` as stored (innermost dimension first, like gguf-py's ``ReaderTensor.shape``),
    ``type`` the ``GGMLQuantizationType`` value, ``offset`` its data's absolute position in the file (bytes)."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_header` found: scalar and string metadata in ``fields``, arrays as (item type, length)
    in ``arrays``, the tensor infos, and ``tokenizer_sha256``: sha256 over the raw bytes (key, type and value
    as stored) of every ``tokenizer.*`` key/value, in key order, so equal digests mean identical tokenizer
    metadata whatever else (tensors, file type, key order) differs."""

    path: Path
    size: int
    version: int
    fields: dict[str, Any]
    arrays: dict[str, tuple[int, int]]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    tokenizer_sha256: str

    def get(self, key: str) -> Any:
        """The value of a scalar or string key; None when absent (or an array)."""
        return self.fields.get(key)

    @property
    def n_elements(self) -> int:
        return sum(t.n_elements for t in self.tensors)


class _Truncated(Exception):
    pass


class _Cursor:
    """Reads little- or big-endian GGUF values from a buffer, raising _Truncated past its end."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.pos, self.size, self.order = buf, 0, len(buf), order

    def take(self, n: int) -> int:
        start, end = self.pos, self.pos + n
        if n < 0 or end > self.size:
            raise _Truncated(f"{n} bytes at offset {start}")
        self.pos = end
        return start

    def scalar(self, code: str) -> Any:
        start = self.take(struct.calcsize(code))
        return struct.unpack_from(self.order + code, self.buf, start)[0]

    def raw_string(self) -> bytes:
        n = self.scalar("Q")
        start = self.take(n)
        return self.buf[start:start + n]

    def skip_strings(self, count: int) -> None:
        if count * 8 > self.size - self.pos:
            raise _Truncated(f"{count} strings at offset {self.pos}")
        unpack, buf, pos = struct.Struct(self.order + "Q").unpack_from, self.buf, self.pos
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
        except struct.error as exc:
            raise _Truncated(f"a string at offset {pos}") from exc
        if pos > self.size:
            raise _Truncated(f"strings ending at offset {pos}")
        self.pos = pos


def _fail(path: Path, message: str) -> NoReturn:
    raise InvalidArtifactError(f"{path.name}: {message}", hint="re-create the file; it is damaged or not a GGUF")


def read_header(path: Path) -> GGUFHeader:
    """Read ``path``'s GGUF header (magic, version, counts, key/values, tensor infos) and check that every
    tensor's data lies inside the file.

    Raises InvalidArtifactError when the file is not a GGUF, is truncated, or its header is corrupt (an unknown
    value or tensor type, a duplicate key or tensor, a bad alignment).
    """
    size = path.stat().st_size
    if size < 24:
        _fail(path, f"{size} bytes is too short for a GGUF header (truncated or not a GGUF)")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(path, buf)
        except _Truncated as exc:
            _fail(path, f"the GGUF header is truncated or corrupt: it runs past the end of the file ({exc}, "
                        f"file has {size} bytes)")
        except (UnicodeDecodeError, ValueError, OverflowError) as exc:
            _fail(path, f"the GGUF header is corrupt ({type(exc).__name__}: {exc})")


def _parse(path: Path, buf: mmap.mmap) -> GGUFHeader:
    from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    magic = struct.unpack_from("<I", buf, 0)[0]
    if magic != GGUF_MAGIC:
        _fail(path, f"bad magic {bytes(buf[:4])!r}, expected {struct.pack('<I', GGUF_MAGIC)!r}")
    # as gguf-py does: a version whose low half is zero was written with the other byte order
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    cur = _Cursor(buf, order)
    cur.take(4)
    version = cur.scalar("I")
    if version not in READER_SUPPORTED_VERSIONS:
        _fail(path, f"GGUF version {version}, expected one of {list(READER_SUPPORTED_VERSIONS)}")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    fields, arrays, tokenizer = _read_kvs(path, cur, n_kv)
    infos = _read_tensor_infos(path, cur, n_tensors)
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        _fail(path, f"general.alignment is {alignment!r}, expected a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = tuple(_tensor(path, data_offset, *info) for info in infos)
    for t in tensors:
        if t.offset + t.n_bytes > cur.size:
            _fail(path, f"tensor {t.name} ends at byte {t.offset + t.n_bytes} but the file has {cur.size} bytes "
                        "(truncated)")
    digest = hashlib.sha256()
    for key in sorted(tokenizer):
        start, end = tokenizer[key]
        digest.update(buf[start:end])
    return GGUFHeader(path=path, size=cur.size, version=version, fields=fields, arrays=arrays, tensors=tensors,
                      alignment=alignment, data_offset=data_offset, tokenizer_sha256=digest.hexdigest())


def _read_kvs(path: Path, cur: _Cursor, count: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]],
                                                               dict[str, tuple[int, int]]]:
    """Scalars and strings by key, arrays' (item type, length) by key, and the byte span of each tokenizer KV."""
    fields: dict[str, Any] = {}
    arrays: dict[str, tuple[int, int]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(count):
        start = cur.pos
        key = cur.raw_string().decode("utf-8")
        if key in fields or key in arrays:
            _fail(path, f"duplicate key {key!r}")
        vtype = cur.scalar("I")
        if vtype == _ARRAY:
            item, length = cur.scalar("I"), cur.scalar("Q")
            _skip_array(path, cur, item, length)
            arrays[key] = (item, length)
        else:
            fields[key] = _value(path, cur, vtype, key)
        if key.startswith(TOKENIZER_PREFIX):
            spans[key] = (start, cur.pos)
    return fields, arrays, spans


def _value(path: Path, cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype == _STRING:
        return cur.raw_string().decode("utf-8")
    code = _SCALARS.get(vtype)
    if code is None:
        _fail(path, f"key {key!r} has unknown value type {vtype}")
    return cur.scalar(code)


def _skip_array(path: Path, cur: _Cursor, item: int, length: int) -> None:
    if item == _STRING:
        cur.skip_strings(length)
    elif item == _ARRAY:  # arrays of arrays: each element is (item type, length, items)
        for _ in range(length):
            sub, n = cur.scalar("I"), cur.scalar("Q")
            _skip_array(path, cur, sub, n)
    elif item in _SCALARS:
        cur.take(length * struct.calcsize(_SCALARS[item]))
    else:
        _fail(path, f"array of unknown value type {item} at offset {cur.pos}")


def _read_tensor_infos(path: Path, cur: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    infos = []
    names: set[str] = set()
    for _ in range(count):
        name = cur.raw_string().decode("utf-8")
        if name in names:
            _fail(path, f"duplicate tensor {name!r}")
        names.add(name)
        n_dims = cur.scalar("I")
        start = cur.take(8 * n_dims)
        dims = struct.unpack_from(f"{cur.order}{n_dims}Q", cur.buf, start)
        infos.append((name, tuple(int(d) for d in dims), cur.scalar("I"), cur.scalar("Q")))
    return infos


def _tensor(path: Path, data_offset: int, name: str, shape: tuple[int, ...], raw_type: int,
            offset: int) -> TensorInfo:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
    except (ValueError, KeyError):
        _fail(path, f"tensor {name} has unknown type {raw_type}")
    n_elements = 1
    for d in shape:
        n_elements *= d
    # the size as gguf-py's reader computes it
    return TensorInfo(name=name, shape=shape, type=raw_type, offset=data_offset + offset, n_elements=n_elements,
                      n_bytes=n_elements * type_size // block_size)


__all__ = ["GGUFHeader", "TensorInfo", "read_header"]
