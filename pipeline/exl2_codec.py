"""The EXL2 tensor layout: pack, unpack, dequantize and size one quantized linear layer.

This is the *format* half of Quantyard's EXL2 reference codec (the quantizer that writes it is
``converters/exl2/quantizer.py``). It lives in the pipeline core, imports only the standard library,
``torch`` and ``pipeline.errors``, and is therefore importable by the converter, by the
transformers runner that evaluates EXL2 on CPU (``evaluators/exl2_loader.py``, which may run
in any interpreter that has torch) and by the GPU truth script; an import-linter contract keeps it
that light. It was written from exllamav2 0.3.2's sources (``conversion/adaptivegptq.py`` ``pack``,
``exllamav2_ext/cuda/pack_tensor.cu``, ``q_matrix.cu``, ``quant/qdq_util.cuh``, ``ext.py``
``make_q_matrix``); no code was copied.

One linear layer ``y = x Wᵀ`` with ``W`` of shape ``[out, in]`` is stored as (exllamav2 works on
``Wᵀ``, ``in`` rows by ``out`` columns, columns padded to a multiple of 32):

* ``q_invperm`` int32 ``[in]``: the activation-order permutation, inverted. Quantized row ``k``
  holds original input row ``perm[k]`` where ``perm = argsort(q_invperm)``.
* ``q_groups`` int16 ``[2·G]``: per group, ``(bits, first q_weight row)``. Groups run over the
  permuted rows in order, by descending ``bits`` (the kernels walk 8, 6, 5, 4, 3, then 2-bit rows).
  A group's row count is ``Δ(first q_weight row)·32/bits``; the last group takes the rest.
* ``q_weight`` int32 ``[Σ rows·bits/32, out_padded]``: per group and per column, the group's
  unsigned codes ``q`` as one LSB-first bitstream over consecutive int32 words.
* ``q_scale`` int32 ``[G, out_padded/8]``: a 4-bit code ``c`` per (group, column), eight per word,
  LSB first.
* ``q_scale_max`` fp16 ``[G]``: the group's largest scale.
* ``bias`` fp16 ``[out]`` when the layer has one.

Dequantization, in fp16 exactly as the CUDA kernels round it::

    m  = fp16(q_scale_max · 1/256)                   # make_q_matrix's in-place prescale
    s  = fp16(fp16((c + 1)²) · m)                     # dq_scale
    Wᵀ[perm[k], n] = fp16(fp16(q − 2^(bits−1)) · s)   # dq, one rounding per product

Every product of two fp16 numbers is exact in float32, so computing it in float32 and rounding
once to fp16 should reproduce the GPU's round-to-nearest-even results bit for bit. That is this module's design,
not a measured fact: the comparison with ExLlamaV2's own reconstruction (``tests/converters/test_exl2_gpu.py``, run
by ``scripts/gpu-check.sh run-exl2`` on a CUDA machine) has not passed on a GPU; how it went is in
``pipeline/status.py`` (the one record of what ran on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pipeline.errors import EXL2FormatError

BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
SCALE_BITS = 4
ROW_ALIGN = 32  # group sizes are multiples of 32 rows: every group then fills whole int32 words
COLUMN_ALIGN = 32  # exllamav2 pads the output dimension to a multiple of 32
TENSOR_SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")


@dataclass(frozen=True)
class Group:
    """A run of consecutive permuted input rows quantized with ``bits`` bits."""

    bits: int
    rows: int


@dataclass
class EXL2Linear:
    """One quantized linear layer, decoded (codes as integers, not yet bit-packed).

    ``q`` int16 ``[in, out_padded]`` holds the unsigned codes in permuted row order, ``scale_codes``
    int16 ``[G, out_padded]`` the 4-bit scale codes ``c`` (0..15), ``scale_max`` fp16 ``[G]``,
    ``invperm`` int32 ``[in]``, ``bias`` fp16 ``[out]`` or None, ``out_features`` the unpadded width.
    """

    q: torch.Tensor
    scale_codes: torch.Tensor
    scale_max: torch.Tensor
    groups: tuple[Group, ...]
    invperm: torch.Tensor
    out_features: int
    bias: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return int(self.q.shape[0])


def padded(columns: int) -> int:
    return columns + (-columns % COLUMN_ALIGN)


def validate_groups(groups: Sequence[Group], rows: int) -> None:
    """Raise EXL2FormatError unless ``groups`` is a layout exllamav2's kernels accept for ``rows``."""
    if not groups:
        raise EXL2FormatError("an EXL2 layer needs at least one group, found none")
    for i, g in enumerate(groups):
        if g.bits not in BITS:
            raise EXL2FormatError(f"group {i} has {g.bits} bits: expected one of {BITS}")
        if g.rows <= 0 or g.rows % ROW_ALIGN:
            raise EXL2FormatError(f"group {i} has {g.rows} rows: expected a positive multiple of {ROW_ALIGN}")
        if i and g.bits > groups[i - 1].bits:
            raise EXL2FormatError(f"group {i} has {g.bits} bits after a {groups[i - 1].bits}-bit group: "
                                  "expected groups ordered by descending bits (the kernels require it)")
    total = sum(g.rows for g in groups)
    if total != rows:
        raise EXL2FormatError(f"groups cover {total} rows, the layer has {rows}")


# --- bit packing ---------------------------------------------------------------------------------


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 → the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _word_index(rows: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(rows, dtype=torch.int64) * bits
    return pos // 32, pos % 32


def pack_columns(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes ``q`` ``[rows, cols]`` into int32 ``[rows·bits/32, cols]``.

    Each column is one LSB-first bitstream: code ``i`` occupies stream bits ``[i·bits, (i+1)·bits)``.
    """
    rows = int(q.shape[0])
    if bits not in BITS or (rows * bits) % 32:
        raise EXL2FormatError(f"cannot pack {rows} rows at {bits} bits: rows·bits must fill whole int32 words")
    v = q.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise EXL2FormatError(f"codes must lie in 0..{(1 << bits) - 1} for {bits} bits")
    word, shift = _word_index(rows, bits)
    out = torch.zeros((rows * bits // 32, v.shape[1]), dtype=torch.int64)
    out.index_add_(0, word, (v << shift[:, None]) & 0xFFFFFFFF)
    spill = shift + bits > 32
    if bool(spill.any()):
        out.index_add_(0, word[spill] + 1, v[spill] >> (32 - shift[spill, None]))
    return _to_int32(out)


#: Values per chunk that ends exactly on an int32 boundary, for each width (chunk·bits is a multiple of 32).
_CHUNK = {2: 16, 3: 32, 4: 8, 5: 32, 6: 16, 8: 4}


def unpack_columns(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of :func:`pack_columns`: int32 ``[rows·bits/32, cols]`` → int16 codes ``[rows, cols]``.

    Works chunk-wise: a chunk of ``_CHUNK[bits]`` values fills ``_CHUNK[bits]·bits/32`` whole words,
    so each value position inside a chunk is one strided slice (plus its neighbour word when it
    straddles a word boundary).
    """
    if (rows * bits) % 32 or packed.shape[0] != rows * bits // 32:
        raise EXL2FormatError(f"{packed.shape[0]} words cannot hold {rows} rows at {bits} bits")
    chunk = _CHUNK[bits]
    per = chunk * bits // 32
    cols = packed.shape[1]
    if rows % chunk:  # only possible for 16-row chunks of a 2/6-bit layer with rows ≡ 16 mod 32: stay general
        return _unpack_slow(packed, bits, rows)
    words = packed.view(rows // chunk, per, cols).transpose(0, 1).contiguous()  # [per, chunks, cols]
    out = torch.empty((chunk, rows // chunk, cols), dtype=torch.int16)
    mask = (1 << bits) - 1
    for i in range(chunk):
        w, shift = divmod(i * bits, 32)
        if shift + bits <= 32:
            value = (words[w] >> shift) & mask  # arithmetic shift: the mask drops the sign bits
        else:
            value = ((words[w] >> shift) & ((1 << (32 - shift)) - 1)) | ((words[w + 1] << (32 - shift)) & mask)
        out[i] = value
    return out.transpose(0, 1).reshape(rows, cols)


def _unpack_slow(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    words = packed.to(torch.int64) & 0xFFFFFFFF
    word, shift = _word_index(rows, bits)
    lo = words[word] >> shift[:, None]
    nxt = torch.clamp(word + 1, max=max(words.shape[0] - 1, 0))
    hi = torch.where((shift + bits > 32)[:, None], words[nxt] << (32 - shift[:, None]), 0)
    return ((lo | hi) & ((1 << bits) - 1)).to(torch.int16)


def pack_scales(codes: torch.Tensor) -> torch.Tensor:
    """4-bit scale codes ``[G, cols]`` (0..15, cols a multiple of 8) → int32 ``[G, cols/8]``."""
    g, cols = codes.shape
    if cols % 8:
        raise EXL2FormatError(f"scale rows need a multiple of 8 columns, found {cols}")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > 15):
        raise EXL2FormatError("scale codes must lie in 0..15")
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return _to_int32((c.view(g, cols // 8, 8) << shifts).sum(dim=2))


def unpack_scales(packed: torch.Tensor) -> torch.Tensor:
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return ((words[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1).to(torch.int16)


# --- groups --------------------------------------------------------------------------------------


def encode_groups(groups: Sequence[Group]) -> torch.Tensor:
    """``q_groups``: int16 ``(bits, first q_weight row)`` per group."""
    out, qrow = [], 0
    for g in groups:
        out += [g.bits, qrow]
        qrow += g.rows * g.bits // 32
    if qrow >= 2**15:
        raise EXL2FormatError(f"q_weight would have {qrow} rows; q_groups offsets are int16 (max 32767)")
    return torch.tensor(out, dtype=torch.int16)


def decode_groups(q_groups: torch.Tensor, rows: int) -> tuple[Group, ...]:
    """Group layout from ``q_groups`` and the layer's input rows (the last group takes the rest)."""
    flat = q_groups.to(torch.int64).reshape(-1).tolist()
    if len(flat) % 2 or not flat:
        raise EXL2FormatError(f"q_groups must hold (bits, offset) pairs, found {len(flat)} values")
    bits, offs = flat[0::2], flat[1::2]
    groups, used = [], 0
    for i, b in enumerate(bits):
        if b not in BITS:
            raise EXL2FormatError(f"q_groups entry {i} has {b} bits: expected one of {BITS}")
        n = (offs[i + 1] - offs[i]) * 32 // b if i + 1 < len(bits) else rows - used
        groups.append(Group(b, n))
        used += n
    validate_groups(groups, rows)
    return tuple(groups)


def group_of_rows(groups: Sequence[Group]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([g.rows for g in groups]))


# --- tensors <-> decoded layer --------------------------------------------------------------------


def encode(layer: EXL2Linear) -> dict[str, torch.Tensor]:
    """The on-disk tensors of a layer, keyed by suffix (``q_weight``, ..., optional ``bias``)."""
    validate_groups(layer.groups, layer.in_features)
    cols = padded(layer.out_features)
    if layer.q.shape[1] != cols or layer.scale_codes.shape != (len(layer.groups), cols):
        raise EXL2FormatError(f"codes must be [{layer.in_features}, {cols}] and scales [{len(layer.groups)}, {cols}]"
                              f", found {tuple(layer.q.shape)} and {tuple(layer.scale_codes.shape)}")
    parts, row = [], 0
    for g in layer.groups:
        parts.append(pack_columns(layer.q[row:row + g.rows], g.bits))
        row += g.rows
    out = {"q_weight": torch.cat(parts).contiguous(), "q_scale": pack_scales(layer.scale_codes),
           "q_scale_max": layer.scale_max.to(torch.float16).contiguous(), "q_groups": encode_groups(layer.groups),
           "q_invperm": layer.invperm.to(torch.int32).contiguous()}
    if layer.bias is not None:
        out["bias"] = layer.bias.to(torch.float16).contiguous()
    return out


def decode(tensors: Mapping[str, torch.Tensor], out_features: int | None = None) -> EXL2Linear:
    """Decode a layer's tensors (keyed by suffix). ``out_features`` defaults to the bias length or
    the padded width; pass it for an unbiased layer whose width is not a multiple of 32."""
    missing = [k for k in TENSOR_SUFFIXES if k not in tensors]
    if missing:
        raise EXL2FormatError(f"EXL2 layer is missing {', '.join(missing)}")
    invperm = tensors["q_invperm"].to(torch.int64)
    rows = int(invperm.numel())
    groups = decode_groups(tensors["q_groups"], rows)
    qw = tensors["q_weight"]
    expected = sum(g.rows * g.bits // 32 for g in groups)
    if qw.shape[0] != expected:
        raise EXL2FormatError(f"q_weight has {qw.shape[0]} rows, its groups need {expected}")
    bias = tensors.get("bias")
    width = out_features if out_features is not None else (int(bias.numel()) if bias is not None else qw.shape[1])
    if padded(width) != qw.shape[1] or tensors["q_scale"].shape != (len(groups), qw.shape[1] // 8):
        raise EXL2FormatError(f"q_weight is {qw.shape[1]} columns wide and q_scale {tuple(tensors['q_scale'].shape)}"
                              f"; a layer {width} wide with {len(groups)} groups needs {padded(width)} and "
                              f"({len(groups)}, {padded(width) // 8})")
    if sorted(invperm.tolist()) != list(range(rows)):
        raise EXL2FormatError("q_invperm is not a permutation of the input rows")
    parts, qrow = [], 0
    for g in groups:
        n = g.rows * g.bits // 32
        parts.append(unpack_columns(qw[qrow:qrow + n], g.bits, g.rows))
        qrow += n
    return EXL2Linear(q=torch.cat(parts), scale_codes=unpack_scales(tensors["q_scale"]),
                      scale_max=tensors["q_scale_max"].to(torch.float16), groups=groups,
                      invperm=invperm.to(torch.int32), out_features=width,
                      bias=None if bias is None else bias.to(torch.float16))


# --- dequantization ------------------------------------------------------------------------------


def _fp16_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp16 × fp16 rounded once to fp16 (the float32 product of two fp16 values is exact)."""
    return (a.to(torch.float16).float() * b.to(torch.float16).float()).to(torch.float16)


def group_scales(scale_codes: torch.Tensor, scale_max: torch.Tensor) -> torch.Tensor:
    """fp16 scales ``[G, cols]`` exactly as the kernels derive them from the stored codes and maxima."""
    m = _fp16_mul(scale_max.to(torch.float16), torch.tensor(1.0 / 256.0, dtype=torch.float16))
    sq = ((scale_codes.to(torch.int64) + 1) ** 2).to(torch.float16)
    return _fp16_mul(sq, m[:, None])


def dequantize_layer(layer: EXL2Linear) -> torch.Tensor:
    """The fp16 weight ``[out, in]`` (the transformers orientation) of a decoded layer."""
    scales = group_scales(layer.scale_codes, layer.scale_max).float()  # exact fp16 values
    dq = torch.empty(layer.q.shape, dtype=torch.float16)
    row = 0
    for gi, g in enumerate(layer.groups):
        codes = layer.q[row:row + g.rows].float() - float(1 << (g.bits - 1))
        dq[row:row + g.rows] = codes.mul_(scales[gi]).to(torch.float16)  # exact product, one rounding
        row += g.rows
    w_t = dq[layer.invperm.to(torch.int64), :layer.out_features]  # Wᵀ[perm[k]] = dq[k] ⇔ Wᵀ[j] = dq[invperm[j]]
    return w_t.t().contiguous()


def dequantize(tensors: Mapping[str, torch.Tensor], out_features: int | None = None) -> torch.Tensor:
    """fp16 weight ``[out, in]`` of one EXL2 layer given its on-disk tensors (keyed by suffix)."""
    return dequantize_layer(decode(tensors, out_features))


# --- size accounting -----------------------------------------------------------------------------


def storage_bits(groups: Sequence[Group], in_features: int, out_features: int, bias: bool = False) -> int:
    """Exact bits of a layer's tensors on disk (what :func:`encode` produces), padding included."""
    cols = padded(out_features)
    n_groups = len(groups)
    total = sum(g.rows * g.bits for g in groups) * cols  # q_weight
    total += n_groups * cols * SCALE_BITS  # q_scale
    total += n_groups * 16 + n_groups * 2 * 16  # q_scale_max, q_groups
    total += in_features * 32  # q_invperm
    total += out_features * 16 if bias else 0
    return total


def layer_prefixes(names: Sequence[str]) -> list[str]:
    """The layer prefixes of every EXL2-quantized layer among tensor names (``x.q_weight`` → ``x``)."""
    return sorted(n[: -len(".q_weight")] for n in names if n.endswith(".q_weight"))


def split_layer(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of layer ``prefix`` keyed by suffix."""
    out = {s: tensors[f"{prefix}.{s}"] for s in TENSOR_SUFFIXES if f"{prefix}.{s}" in tensors}
    if f"{prefix}.bias" in tensors:
        out["bias"] = tensors[f"{prefix}.bias"]
    return out
