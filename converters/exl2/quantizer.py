"""Quantyard's reference EXL2 quantizer (CPU, pure torch): per-layer GPTQ with activation order at a
chosen bit layout, per-layer error measurement, and a greedy bit allocation that meets a target bpw.

It writes tensors in exllamav2's exact layout (``pipeline/exl2_codec.py``), so exllamav2 can load
them, but it is **not** exllamav2's optimizer. Differences, stated plainly:

* Candidate layouts (:data:`OPTIONS`) are Quantyard's own short list of uniform and two-width mixes,
  not exllamav2's per-layer-type tables; the head uses one uniform width (group 32).
* Hessians come from one pass of the *unquantized* model over the calibration rows (every layer
  sees clean inputs); exllamav2 quantizes layer by layer, feeding quantized outputs forward.
* A layer's error is its relative calibration output error ``‖(W−Ŵ)X‖²/‖WX‖²`` (exact, from the
  Hessian); exllamav2 measures whole attention/MLP blocks.
* Bits are allocated greedily on each layer's lower convex hull of (bits, error), upgrading the
  layer with the best error reduction per extra bit until the budget is spent; exllamav2 uses
  simulated annealing over block-level options.
* Scales: per (group, output column) a 4-bit code on a square-root grid below the group maximum,
  with the group maximum chosen by a small grid search over shrink factors (Hessian-diagonal
  weighted squared error). Quantization uses the exact fp16 scales the kernels will use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.errors import ConversionError, InvalidSpecError
from pipeline.exl2_codec import (
    BITS,
    ROW_ALIGN,
    EXL2Linear,
    Group,
    dequantize_layer,
    group_scales,
    padded,
    storage_bits,
    validate_groups,
)

P_GRID = tuple(0.70 + 0.05 * i for i in range(11))  # shrink factors tried for a group's maximum scale
DAMP = 0.01  # GPTQ dampening, as a fraction of the mean Hessian diagonal
HEAD_GROUP = 32


@dataclass(frozen=True)
class Option:
    """A bit layout for one layer: ``parts`` are (bits, share of rows), widest first; one group size."""

    parts: tuple[tuple[int, float], ...]
    group_size: int

    @property
    def name(self) -> str:
        return "/".join(f"{p:g}:{b}b" for b, p in self.parts) + f" g{self.group_size}"

    def groups(self, rows: int) -> tuple[Group, ...]:
        """The group layout over ``rows`` permuted input rows (most important rows get the most bits)."""
        if rows % ROW_ALIGN:
            raise InvalidSpecError(f"EXL2 needs input widths that are multiples of {ROW_ALIGN}, found {rows}")
        out: list[Group] = []
        remaining = rows
        for i, (bits, share) in enumerate(self.parts):
            last = i == len(self.parts) - 1
            n = remaining if last else min(remaining, math.ceil(rows * share / self.group_size) * self.group_size)
            while n > 0:
                g = min(self.group_size, n)
                out.append(Group(bits, g))
                n -= g
                remaining -= g
        return tuple(out)


def _opt(group: int, *parts: tuple[int, float]) -> Option:
    return Option(parts=tuple(parts), group_size=group)


#: Quantyard's candidate layouts for decoder layers, from about 2.1 to 8.0 bits per weight.
OPTIONS: tuple[Option, ...] = (
    _opt(32, (2, 1.0)),
    _opt(32, (3, 0.5), (2, 0.5)),
    _opt(64, (3, 1.0)),
    _opt(64, (4, 0.25), (3, 0.75)),
    _opt(64, (4, 0.5), (3, 0.5)),
    _opt(128, (4, 1.0)),
    _opt(32, (4, 1.0)),
    _opt(64, (5, 0.5), (4, 0.5)),
    _opt(128, (5, 1.0)),
    _opt(128, (6, 0.5), (5, 0.5)),
    _opt(128, (6, 1.0)),
    _opt(128, (8, 0.5), (6, 0.5)),
    _opt(128, (8, 1.0)),
)


def head_option(bits: int) -> Option:
    if bits not in BITS:
        raise InvalidSpecError(f"EXL2 head bits must be one of {BITS}, got {bits}")
    return _opt(HEAD_GROUP, (bits, 1.0))


# --- scales --------------------------------------------------------------------------------------


def find_group_params(w: torch.Tensor, bits: int, h_diag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale codes ``[out]`` (0..15) and the fp16 maximum scale for a group ``w`` ``[rows, out]``.

    Codes follow a square-root grid of each column's range relative to the group's largest; the
    maximum is shrunk by the factor in :data:`P_GRID` that minimises the ``h_diag``-weighted
    squared rounding error.
    """
    zero = 1 << (bits - 1)
    base = w.abs().amax(dim=0).clamp_min(1e-10) / (zero - 0.5)
    top = base.max()
    codes = (torch.sqrt(base / top) * 16).round().clamp(1, 16).to(torch.int16) - 1
    smax = (top * torch.tensor(P_GRID)).clamp(max=65000.0).to(torch.float16)  # [P]
    scale = group_scales(codes[None].expand(len(P_GRID), -1), smax).float()[:, None, :]  # [P, 1, out]
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.clamp(torch.round(w[None] * inv), -zero, zero - 1)
    err = (((q * scale - w[None]) ** 2) * h_diag[None, :, None]).sum(dim=(1, 2))
    return codes, smax[int(torch.argmin(err))]


# --- GPTQ ----------------------------------------------------------------------------------------


@dataclass
class Quantized:
    layer: EXL2Linear
    error: float  # relative calibration output error ‖(W−Ŵ)X‖² / ‖WX‖²
    bits: int  # storage bits of the layer's tensors


def _upper_inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H⁻¹, with dampening increased until H is positive definite."""
    damp = DAMP * float(torch.diag(h).mean().clamp_min(1e-8))
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    for _ in range(8):
        try:
            inv = torch.cholesky_inverse(torch.linalg.cholesky(h + damp * eye))
            return torch.linalg.cholesky(inv, upper=True)
        except torch.linalg.LinAlgError:
            damp *= 10
    raise ConversionError("GPTQ: the calibration Hessian is not positive definite even after dampening",
                          hint="use more (or more varied) calibration text")


def relative_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """‖(W−Ŵ)X‖² / ‖WX‖² given H = XᵀX (weights ``[out, in]``)."""
    d = approx.float() - weight.float()
    h = hessian.float()
    num = float(((d @ h) * d).sum(dtype=torch.float64))
    den = float(((weight.float() @ h) * weight.float()).sum(dtype=torch.float64))
    return num / den if den > 0 else num


@dataclass
class _State:
    """Per-layout GPTQ state: the current group's scales and the codes/scales found so far."""

    groups: tuple[Group, ...]
    starts: dict[int, int]  # first permuted row -> group index
    codes: torch.Tensor  # [G, cols] int16
    smax: torch.Tensor  # [G] fp16


def gptq(weight: torch.Tensor, hessian: torch.Tensor, groups: Sequence[Group],
         bias: torch.Tensor | None = None) -> Quantized:
    """Quantize ``weight`` ``[out, in]`` with GPTQ in activation order at the layout ``groups``.

    ``hessian`` is ``XᵀX`` of the layer's calibration inputs ``[in, in]`` (any positive scale).
    """
    return gptq_many(weight, hessian, [tuple(groups)], bias)[0]


def gptq_many(weight: torch.Tensor, hessian: torch.Tensor, layouts: Sequence[tuple[Group, ...]],
              bias: torch.Tensor | None = None) -> list[Quantized]:
    """:func:`gptq` at several layouts at once: they share the ordering and the inverse Hessian,
    and their rows are processed together (one Python loop over input rows for all layouts)."""
    out_f, in_f = weight.shape
    h = hessian.to(torch.float32).clone()
    w = weight.to(torch.float32).t().clone()  # [in, out]: exllamav2's orientation, rows = inputs
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True)
    w, h = w[perm], h[perm][:, perm]
    u = _upper_inverse_cholesky(h)
    cols = padded(out_f)
    states = []
    for groups in layouts:
        validate_groups(groups, in_f)
        starts, row = {}, 0
        for gi, g in enumerate(groups):
            starts[row] = gi
            row += g.rows
        states.append(_State(groups, starts, torch.zeros((len(groups), cols), dtype=torch.int16),
                             torch.zeros(len(groups), dtype=torch.float16)))
    q = _gptq_rows(w.unsqueeze(0).repeat(len(layouts), 1, 1), u, torch.diag(h), states, cols)
    out = []
    for k, st in enumerate(states):
        layer = EXL2Linear(q=q[k], scale_codes=st.codes, scale_max=st.smax, groups=st.groups,
                           invperm=torch.argsort(perm).to(torch.int32), out_features=out_f,
                           bias=None if bias is None else bias.to(torch.float16))
        err = relative_error(weight, dequantize_layer(layer).float(), hessian)
        out.append(Quantized(layer=layer, error=err, bits=storage_bits(st.groups, in_f, out_f, bias is not None)))
    return out


def _gptq_rows(w: torch.Tensor, u: torch.Tensor, h_diag: torch.Tensor, states: list[_State], cols: int
               ) -> torch.Tensor:
    """Quantize ``w`` ``[L, in, out]`` (one copy per layout) row by row, 32 rows per lazy block,
    pushing each row's rounding error onto the rows after it. Returns codes ``[L, in, cols]``."""
    n, in_f, out_f = w.shape
    q = torch.zeros((n, in_f, cols), dtype=torch.int16)
    scale = torch.zeros((n, out_f))
    inv = torch.zeros((n, out_f))
    zero = torch.zeros((n, 1))
    for a in range(0, in_f, ROW_ALIGN):
        for k, st in enumerate(states):
            if a in st.starts:
                gi = st.starts[a]
                g = st.groups[gi]
                c, m = find_group_params(w[k, a:a + g.rows], g.bits, h_diag[a:a + g.rows])
                st.codes[gi, :out_f], st.smax[gi] = c, m
                scale[k] = group_scales(c[None], m.reshape(1))[0].float()
                inv[k] = torch.where(scale[k] > 0, 1.0 / scale[k], torch.zeros_like(scale[k]))
                zero[k] = 1 << (g.bits - 1)
                q[k, a:a + g.rows, out_f:] = 1 << (g.bits - 1)  # padding columns hold the zero code
        b = a + ROW_ALIGN
        block = w[:, a:b].clone()
        errs = torch.zeros_like(block)
        ub = u[a:b, a:b]
        for i in range(b - a):
            row = block[:, i]
            codes = torch.clamp(torch.round(row * inv), -zero, zero - 1)
            q[:, a + i, :out_f] = (codes + zero).to(torch.int16)
            e = (row - codes * scale) / ub[i, i]
            block[:, i:] -= ub[i, i:, None] * e[:, None, :]
            errs[:, i] = e
        w[:, b:] -= torch.matmul(u[a:b, b:].t(), errs)
    return q


def measure_layer(weight: torch.Tensor, hessian: torch.Tensor, bias: bool,
                  options: Sequence[Option] = OPTIONS) -> list[dict[str, float | int]]:
    """Quantize one layer at every option; return [{option, bits, error}] (bits exact, on disk)."""
    layouts = [opt.groups(weight.shape[1]) for opt in options]
    results = gptq_many(weight, hessian, layouts, torch.zeros(weight.shape[0]) if bias else None)
    return [{"option": i, "bits": r.bits, "error": r.error} for i, r in enumerate(results)]


# --- bit allocation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidates:
    """A layer's measured options: storage bits and relative error per option index."""

    name: str
    numel: int
    bits: tuple[int, ...]
    errors: tuple[float, ...]


def lower_hull(c: Candidates) -> list[int]:
    """Option indices on the lower convex hull of (bits, error), cheapest first, error decreasing."""
    order = sorted(range(len(c.bits)), key=lambda i: (c.bits[i], c.errors[i]))
    hull: list[int] = []
    for i in order:
        if hull and c.errors[i] >= c.errors[hull[-1]]:
            continue
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when going a→i is at least as efficient as a→b (error saved per bit)
            if (c.errors[a] - c.errors[i]) * (c.bits[b] - c.bits[a]) >= \
                    (c.errors[a] - c.errors[b]) * (c.bits[i] - c.bits[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def allocate(layers: Sequence[Candidates], target_bpw: float) -> tuple[dict[str, int], float]:
    """Choose one option per layer so total bits ≤ ``target_bpw`` × weights, greedily minimising the
    summed relative error. Returns ({layer: option index}, achieved bpw). When even the cheapest
    options exceed the budget, the cheapest are returned (the achieved bpw says so)."""
    numel = sum(c.numel for c in layers)
    budget = target_bpw * numel
    hulls = {c.name: lower_hull(c) for c in layers}
    pos = dict.fromkeys(hulls, 0)
    by_name = {c.name: c for c in layers}
    total = sum(by_name[n].bits[h[0]] for n, h in hulls.items())
    while True:
        best: tuple[float, str] | None = None
        for name, hull in hulls.items():
            if pos[name] + 1 >= len(hull):
                continue
            c, cur, nxt = by_name[name], hull[pos[name]], hull[pos[name] + 1]
            dbits = c.bits[nxt] - c.bits[cur]
            if total + dbits > budget:
                continue
            gain = (c.errors[cur] - c.errors[nxt]) / dbits
            if best is None or gain > best[0]:
                best = (gain, name)
        if best is None:
            break
        name = best[1]
        c, hull = by_name[name], hulls[name]
        total += c.bits[hull[pos[name] + 1]] - c.bits[hull[pos[name]]]
        pos[name] += 1
    return {n: hulls[n][pos[n]] for n in hulls}, total / numel if numel else 0.0
