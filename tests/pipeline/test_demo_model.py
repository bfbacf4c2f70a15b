"""The demo checkpoint is a pure function of its recipe and corpus: two builds are byte-identical, so
the same source identity (and registry keys) comes out on every machine."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
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


def test_demo_model_without_dest_only_builds_into_the_cache(demo_model: Path, cache_dir: Path, tmp_path: Path) -> None:
    """What `make demo` runs while llama.cpp compiles: the cached checkpoint (here already built), nothing copied;
    with DEST the same checkpoint is copied there."""
    env = {**os.environ, "QUANTYARD_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cli = [sys.executable, "-m", "pipeline.cli", "demo-model"]
    alone = subprocess.run(cli, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert f"cached at {demo_model}" in " ".join(alone.stdout.split()) and list(tmp_path.iterdir()) == []
    copied = subprocess.run([*cli, str(tmp_path / "copy")], env=env, capture_output=True, text=True, timeout=300)
    assert copied.returncode == 0, copied.stdout + copied.stderr
    assert _digests(tmp_path / "copy") == _digests(demo_model)
