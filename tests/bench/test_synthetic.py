"""bench/synthetic.py writes a SYNTHETIC checkpoint of a published shape shard by shard: here the ``tiny`` shape
(the same code path as Llama-3-8B's, in seconds), split into several shards, which Quantyard's checks accept,
whose facts the pre-flight reads from its headers alone, and which transformers loads and runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from converters.checkpoint import load_checkpoint, read_facts
from tests.bench import load_script

synthetic = load_script("synthetic")


def test_a_synthetic_checkpoint_is_a_real_checkpoint_of_its_shape(tmp_path: Path, demo_model: Path) -> None:
    out = synthetic.build(tmp_path / "tiny", "tiny", "bfloat16", demo_model, shard_bytes=1_000_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    marker = json.loads((out / synthetic.MARKER).read_text())
    assert "SYNTHETIC" in marker["note"] and marker["recipe"]["shape"] == "tiny"
    shape = synthetic.SHAPES["tiny"]
    vocab = json.loads((demo_model / "config.json").read_text())["vocab_size"]
    expected = sum(math.prod(s) for _, s, _ in synthetic.tensor_shapes(shape, vocab))
    assert marker["n_params"] == expected

    ckpt = load_checkpoint(out)  # shapes against a model on the meta device, the tokenizer, NaN/Inf
    facts = read_facts(out)
    assert facts is not None and facts.n_params == ckpt.n_params == expected and facts.dtype == "bfloat16"
    assert facts.layers == shape["num_hidden_layers"] and facts.kv_width == shape["num_key_value_heads"] * 64

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    logits = model(torch.tensor([[1, 5, 9, 14]])).logits
    assert logits.shape == (1, 4, vocab) and torch.isfinite(logits).all()

    again = synthetic.build(out, "tiny", "bfloat16", demo_model, shard_bytes=1_000_000)  # the same recipe: kept
    assert again == out and sorted(out.glob("model-*.safetensors")) == shards
