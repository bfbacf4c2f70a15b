"""The demo checkpoint is a pure function of its recipe and corpus: two builds are byte-identical, so
the same source identity (and registry keys) comes out on every machine."""

from __future__ import annotations

import hashlib
from pathlib import Path

from converters.source import resolve_source
from pipeline.demo_model import DemoRecipe, build_demo_model

TINY = DemoRecipe(vocab_size=512, hidden_size=32, intermediate_size=64, layers=1, heads=2, kv_heads=1, seq_len=32,
                  batch_size=4, steps=3, max_train_bytes=200_000, max_eval_bytes=20_000, max_calib_bytes=20_000)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    build_demo_model(a, TINY)
    build_demo_model(b, TINY)
    assert {"model.safetensors", "tokenizer.model", "tokenizer.json", "quantyard-demo.json"} <= set(_digests(a))
    assert _digests(a) == _digests(b)
    cache = tmp_path / "cache"
    assert resolve_source(str(a), cache_dir=cache).identity == resolve_source(str(b), cache_dir=cache).identity
