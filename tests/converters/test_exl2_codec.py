"""The EXL2 reference codec: the layout (pipeline/exl2_codec.py) and the quantizer
(converters/exl2/quantizer.py). Property tests with hypothesis; the parity test against exllamav2 itself
is the golden-fixture test (tests/converters/test_exl2_golden.py) and the GPU check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from converters.exl2.quantizer import OPTIONS, Candidates, Option, allocate, find_group_params, gptq, lower_hull
from pipeline.errors import EXL2FormatError
from pipeline.exl2_codec import (
    BITS,
    EXL2Linear,
    Group,
    decode,
    dequantize,
    dequantize_layer,
    encode,
    group_scales,
    pack_columns,
    pack_scales,
    padded,
    storage_bits,
    unpack_columns,
    unpack_scales,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _codes(rows: int, cols: int, bits: int, seed: int, fill: str) -> torch.Tensor:
    if fill == "zeros":
        return torch.zeros((rows, cols), dtype=torch.int64)
    if fill == "max":
        return torch.full((rows, cols), (1 << bits) - 1, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (rows, cols), generator=g)


def _kernel_style_pack(q: np.ndarray, bits: int) -> np.ndarray:
    """An independent statement of exllamav2's pack_columns: values are taken in chunks that end on a
    word boundary (16 for 2/6 bits, 32 for 3/5 bits, 8 for 4, 4 for 8) and each value's bits are
    OR-ed into the chunk's words at offset j = i·bits, shifted left (j − 32·w) or right when negative."""
    chunk = {2: 16, 3: 32, 4: 8, 5: 32, 6: 16, 8: 4}[bits]
    words_per_chunk = chunk * bits // 32
    rows, cols = q.shape
    out = np.zeros((rows * bits // 32, cols), dtype=np.uint64)
    for c0 in range(0, rows, chunk):
        for i in range(chunk):
            j = i * bits
            for w in range(words_per_chunk):
                shift = j - 32 * w
                v = q[c0 + i].astype(np.uint64)
                part = (v << np.uint64(shift)) if 0 <= shift < 32 else (v >> np.uint64(-shift)) if -32 < shift < 0 \
                    else np.zeros_like(v)
                out[c0 * bits // 32 + w] |= part & np.uint64(0xFFFFFFFF)
    return out.astype(np.uint32).view(np.int32)


@FAST
@given(bits=st.sampled_from(BITS), blocks=st.integers(1, 4), cols=st.integers(1, 40), seed=st.integers(0, 2**31),
       fill=st.sampled_from(["random", "zeros", "max"]))
def test_pack_unpack_is_exact_for_every_width(bits: int, blocks: int, cols: int, seed: int, fill: str) -> None:
    q = _codes(32 * blocks, cols, bits, seed, fill)
    packed = pack_columns(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (32 * blocks * bits // 32, cols)
    assert torch.equal(unpack_columns(packed, bits, 32 * blocks).to(torch.int64), q)
    assert np.array_equal(packed.numpy(), _kernel_style_pack(q.numpy(), bits))


@FAST
@given(groups=st.integers(1, 5), words=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_scale_nibbles_round_trip(groups: int, words: int, seed: int) -> None:
    codes = torch.randint(0, 16, (groups, 8 * words), generator=torch.Generator().manual_seed(seed))
    packed = pack_scales(codes)
    assert packed.shape == (groups, words)
    assert torch.equal(unpack_scales(packed).to(torch.int64), codes)
    # nibble i of word w is column 8w+i, least significant nibble first
    assert int(packed[0, 0]) & 0xF == int(codes[0, 0]) and (int(packed[0, 0]) >> 4) & 0xF == int(codes[0, 1])


@st.composite
def layers(draw: st.DrawFn) -> EXL2Linear:
    """A random EXL2 layer: mixed widths in descending order, group sizes that are multiples of 32,
    any output width (so columns are padded), a random permutation, and an optional bias."""
    widths = sorted(draw(st.lists(st.sampled_from(BITS), min_size=1, max_size=4)), reverse=True)
    groups = tuple(Group(b, 32 * draw(st.integers(1, 4))) for b in widths)
    rows = sum(g.rows for g in groups)
    out = draw(st.integers(1, 80))
    cols = padded(out)
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    q = torch.cat([torch.randint(0, 1 << g.bits, (g.rows, cols), generator=gen) for g in groups]).to(torch.int16)
    smax = (torch.rand(len(groups), generator=gen) * 0.1 + draw(st.sampled_from([1e-6, 1e-3, 0.05]))).half()
    return EXL2Linear(q=q, scale_codes=torch.randint(0, 16, (len(groups), cols), generator=gen).to(torch.int16),
                      scale_max=smax, groups=groups, invperm=torch.randperm(rows, generator=gen).to(torch.int32),
                      out_features=out,
                      bias=torch.randn(out, generator=gen).half() if draw(st.booleans()) else None)


def _naive_dequantize(layer: EXL2Linear) -> np.ndarray:
    """Element by element with numpy float16 arithmetic (each product rounded once to fp16)."""
    perm = np.argsort(layer.invperm.numpy())
    w_t = np.zeros((layer.in_features, layer.out_features), dtype=np.float16)
    k = 0
    for gi, g in enumerate(layer.groups):
        m = np.float16(layer.scale_max[gi].item()) * np.float16(1 / 256)
        for _ in range(g.rows):
            for n in range(layer.out_features):
                s = np.float16((int(layer.scale_codes[gi, n]) + 1) ** 2) * m
                w_t[perm[k], n] = np.float16(int(layer.q[k, n]) - (1 << (g.bits - 1))) * s
            k += 1
    return w_t.T


@FAST
@given(layer=layers())
def test_layer_round_trip_mixed_groups_and_padding(layer: EXL2Linear) -> None:
    tensors = encode(layer)
    assert tensors["q_weight"].shape == (sum(g.rows * g.bits // 32 for g in layer.groups), padded(layer.out_features))
    back = decode(tensors, layer.out_features)
    assert back.groups == layer.groups and back.out_features == layer.out_features
    assert torch.equal(back.q, layer.q) and torch.equal(back.scale_codes, layer.scale_codes)
    assert torch.equal(back.invperm, layer.invperm) and torch.equal(back.scale_max, layer.scale_max)
    assert (back.bias is None) == (layer.bias is None)
    # bit accounting: the formula is the exact size of what encode() wrote
    on_disk = sum(t.numel() * t.element_size() * 8 for t in tensors.values())
    assert storage_bits(layer.groups, layer.in_features, layer.out_features, layer.bias is not None) == on_disk


@settings(max_examples=15, deadline=None)
@given(layer=layers())
def test_dequantize_rounds_exactly_like_fp16_hardware(layer: EXL2Linear) -> None:
    ours = dequantize(encode(layer), layer.out_features)
    assert ours.dtype == torch.float16 and ours.shape == (layer.out_features, layer.in_features)
    assert np.array_equal(ours.numpy().view(np.uint16), _naive_dequantize(layer).view(np.uint16))


def test_group_scales_keep_fp16_subnormals() -> None:
    # q_scale_max / 256 falls into fp16's subnormal range for small weights; the kernels keep it there
    smax = torch.tensor([2e-3], dtype=torch.float16)
    scale = group_scales(torch.tensor([[0, 7, 15]]), smax)
    m = np.float16(2e-3) * np.float16(1 / 256)
    assert m < np.finfo(np.float16).tiny  # really subnormal
    assert scale[0].tolist() == [float(np.float16(c * c) * m) for c in (1, 8, 16)]


def _bad(layer: EXL2Linear, **change: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**encode(layer), **change}


def test_decode_rejects_malformed_layers() -> None:
    layer = EXL2Linear(q=torch.zeros((64, 32), dtype=torch.int16), scale_codes=torch.zeros((2, 32), dtype=torch.int16),
                       scale_max=torch.ones(2).half(), groups=(Group(4, 32), Group(4, 32)),
                       invperm=torch.arange(64, dtype=torch.int32), out_features=32)
    with pytest.raises(EXL2FormatError, match="descending"):
        decode(_bad(layer, q_groups=torch.tensor([3, 0, 4, 3], dtype=torch.int16)))
    with pytest.raises(EXL2FormatError, match="not a permutation"):
        decode(_bad(layer, q_invperm=torch.zeros(64, dtype=torch.int32)))
    with pytest.raises(EXL2FormatError, match="q_weight has"):
        decode(_bad(layer, q_weight=torch.zeros((7, 32), dtype=torch.int32)))
    with pytest.raises(EXL2FormatError, match="missing q_scale"):
        decode({k: v for k, v in encode(layer).items() if k != "q_scale"})
    with pytest.raises(EXL2FormatError, match="bits"):
        encode(EXL2Linear(q=layer.q, scale_codes=layer.scale_codes[:1], scale_max=layer.scale_max[:1],
                          groups=(Group(7, 64),), invperm=layer.invperm, out_features=32))


# --- the quantizer -------------------------------------------------------------------------------


def _problem(out: int = 64, inp: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and a correlated (low effective rank) input Hessian, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    x = torch.randn(2048, 16, generator=g) @ torch.randn(16, inp, generator=g) + 0.05 * torch.randn(2048, inp,
                                                                                                   generator=g)
    return w, x.t() @ x / x.shape[0]


def test_option_layouts_are_valid_and_ordered() -> None:
    for opt in OPTIONS:
        for rows in (32, 256, 768):
            groups = opt.groups(rows)
            assert sum(g.rows for g in groups) == rows
            assert all(g.rows % 32 == 0 and g.rows <= opt.group_size for g in groups)
            assert [g.bits for g in groups] == sorted((g.bits for g in groups), reverse=True)


def test_gptq_error_falls_with_bits_and_beats_round_to_nearest() -> None:
    w, h = _problem()
    errors = [gptq(w, h, Option(((b, 1.0),), 32).groups(128)).error for b in BITS]
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 1000
    rtn = gptq(w, torch.eye(128), Option(((3, 1.0),), 32).groups(128)).layer  # identity H: plain rounding
    from converters.exl2.quantizer import relative_error

    rtn_err = relative_error(w, dequantize_layer(rtn).float(), h)
    assert gptq(w, h, Option(((3, 1.0),), 32).groups(128)).error < rtn_err / 2


def test_gptq_output_dequantizes_to_what_it_measured() -> None:
    w, h = _problem(out=40)  # 40 columns: padded to 64 on disk
    res = gptq(w, h, OPTIONS[4].groups(128), bias=torch.randn(40))
    tensors = encode(res.layer)
    assert tensors["q_weight"].shape[1] == 64 and tensors["bias"].shape == (40,)
    dq = dequantize(tensors)
    assert dq.shape == (40, 128) and torch.equal(dq, dequantize_layer(res.layer))
    assert res.bits == sum(t.numel() * t.element_size() * 8 for t in tensors.values())
    decoded, row = decode(tensors), 0
    for g in decoded.groups:  # padding columns hold each group's zero code, as exllamav2 writes them
        pad = decoded.q[row:row + g.rows, 40:]
        assert torch.equal(pad, torch.full_like(pad, 1 << (g.bits - 1)))
        row += g.rows


def test_find_group_params_gives_valid_codes() -> None:
    w = torch.randn(64, 48) * torch.linspace(0.01, 1, 48)
    codes, smax = find_group_params(w, 4, torch.ones(64))
    assert codes.dtype == torch.int16 and int(codes.min()) >= 0 and int(codes.max()) == 15
    assert smax.dtype == torch.float16 and float(smax) > 0


@st.composite
def candidate_sets(draw: st.DrawFn) -> list[Candidates]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 6))
        numel = 1024 * draw(st.integers(1, 8))
        bits = sorted(draw(st.lists(st.integers(2 * numel, 9 * numel), min_size=n, max_size=n, unique=True)))
        errs = sorted(draw(st.lists(st.floats(1e-6, 1.0), min_size=n, max_size=n)), reverse=True)
        out.append(Candidates(name=f"l{i}", numel=numel, bits=tuple(bits), errors=tuple(errs)))
    return out


@FAST
@given(layers=candidate_sets(), target=st.floats(2.0, 9.0), more=st.floats(0.0, 2.0))
def test_greedy_allocation_meets_budget_and_improves_with_it(layers: list[Candidates], target: float,
                                                             more: float) -> None:
    numel = sum(c.numel for c in layers)
    choice, bpw = allocate(layers, target)
    cheapest = sum(min(c.bits) for c in layers) / numel
    total_bits = sum(c.bits[choice[c.name]] for c in layers)
    assert bpw == pytest.approx(total_bits / numel)
    if cheapest <= target:
        assert bpw <= target + 1e-9
    else:
        assert bpw == pytest.approx(cheapest)
    error = sum(c.errors[choice[c.name]] for c in layers)
    choice2, _ = allocate(layers, target + more)
    assert sum(c.errors[choice2[c.name]] for c in layers) <= error + 1e-12
    for c in layers:
        hull = lower_hull(c)
        assert choice[c.name] in hull
        assert [c.errors[i] for i in hull] == sorted((c.errors[i] for i in hull), reverse=True)
