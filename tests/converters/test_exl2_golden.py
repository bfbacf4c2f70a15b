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
