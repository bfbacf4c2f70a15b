"""The reference codec against golden fixtures made by ExLlamaV2 itself on a GPU machine.

``tests/fixtures/exl2/golden.safetensors`` holds a few quantized layers (written by exllamav2's
converter and by Quantyard's reference-cpu backend) together with ExLlamaV2's own fp16
reconstruction of each (``<layer>.exllamav2_dq``, ``[in, out_padded]``). They are produced by
``scripts/gpu-check-exl2.sh`` (see tests/fixtures/exl2/README.md). Until they exist this test is
skipped with that reason; it never passes without them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.exl2_codec import decode, dequantize_layer, split_layer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "exl2"
GOLDEN = FIXTURES / "golden.safetensors"


@pytest.mark.skipif(not GOLDEN.is_file(), reason="no golden fixtures from ExLlamaV2 yet: they are made on a GPU "
                    "machine by scripts/gpu-check-exl2.sh (tests/fixtures/exl2/README.md)")
def test_codec_dequantizes_golden_layers_exactly_like_exllamav2() -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(GOLDEN))
    meta = json.loads((FIXTURES / "golden.json").read_text())
    assert meta["layers"], "golden.json lists no layers"
    widths = set()
    for name, info in meta["layers"].items():
        layer = decode(split_layer(tensors, name), out_features=tensors[f"{name}.q_weight"].shape[1])
        widths |= {g.bits for g in layer.groups}
        ours = dequantize_layer(layer).t()[:, : info["out_features"]]
        theirs = tensors[f"{name}.exllamav2_dq"][:, : info["out_features"]]
        assert torch.equal(ours.contiguous().view(torch.int16), theirs.contiguous().view(torch.int16)), name
    assert len(widths) >= 2


def test_exllamav2s_mlp_reordering_is_undone_before_comparing() -> None:
    """ExLlamaV2 0.3.2 loads ``down_proj`` without its permutation and reorders ``gate_proj``/``up_proj``'s output
    columns by it (exllamav2/mlp.py ``load(unmap=True)``, linear.py ``tensor_remap``; reconstruct then writes row k
    to ``q_perm[k]`` only where a permutation is left, q_matrix.cu). Its reconstruction of down is therefore the
    weight's rows taken in ``q_perm`` order, of gate and up their columns: the GPU parity test, and the golden
    fixtures it writes, must undo that, and must leave every other layer as it is."""
    from tests.converters.test_exl2_gpu import _undo_mlp_remap

    g = torch.Generator().manual_seed(0)
    inter, hidden = 96, 32
    q_perm = torch.randperm(inter, generator=g)
    q_invperm = torch.argsort(q_perm).to(torch.int32)  # as exllamav2 derives q_perm = argsort(q_invperm)
    down, gate, up = torch.randn(inter, hidden), torch.randn(hidden, inter), torch.randn(hidden, inter)  # [in, out]
    attn = torch.randn(hidden, hidden)
    theirs = {"l.mlp.down_proj": down[q_perm], "l.mlp.gate_proj": gate[:, q_perm], "l.mlp.up_proj": up[:, q_perm],
              "l.self_attn.q_proj": attn.clone()}
    tensors = {"l.mlp.down_proj.q_invperm": q_invperm,
               "l.self_attn.q_proj.q_invperm": torch.randperm(hidden, generator=g).to(torch.int32)}
    _undo_mlp_remap(theirs, tensors)
    assert torch.equal(theirs["l.mlp.down_proj"], down)
    assert torch.equal(theirs["l.mlp.gate_proj"], gate) and torch.equal(theirs["l.mlp.up_proj"], up)
    assert torch.equal(theirs["l.self_attn.q_proj"], attn)
