from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
from gguf import GGUFReader

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import GGUFConverter, inspect_gguf
from converters.source import resolve_source
from pipeline.config import Settings
from pipeline.errors import TokenizerUnsupportedError, UnsupportedArchitectureError
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.specs import GGUFSpec
from tests.factories import bytelevel_bpe_checkpoint, copy_checkpoint, edit_config


def _ctx(ckpt_dir: Path, settings: Settings, name: str = "demo") -> BuildContext:
    ckpt = load_checkpoint(ckpt_dir)
    src = resolve_source(str(ckpt_dir), cache_dir=settings.cache_dir)
    return BuildContext(checkpoint=ckpt, source=src, model_name=name, settings=settings)


def test_base_once_then_types_from_it(tmp_path: Path, demo_model: Path, settings: Settings) -> None:
    conv = GGUFConverter(settings)
    ctx = _ctx(demo_model, settings)
    first = conv.prepare(ctx, [])
    second = conv.prepare(ctx, [])
    assert first.events == ["convert_base"] and second.events == []
    for t, ftype in (("Q8_0", 7), ("Q4_K_M", 15)):
        built = conv.build(ctx, first, GGUFSpec(type=t), tmp_path / t)
        path = next(iter(built.files.values()))
        reader = GGUFReader(str(path))
        assert reader.get_field("general.file_type").contents() == ftype
        assert reader.get_field("general.architecture").contents() == "llama"
        assert built.info["tensor_count"] == inspect_gguf(Path(first.paths["base"]))["tensor_count"]


def test_python_quantize_is_byte_identical_to_llama_quantize(tmp_path: Path, demo_model: Path,
                                                             settings: Settings) -> None:
    conv = GGUFConverter(settings)
    ctx = _ctx(demo_model, settings)
    prepared = conv.prepare(ctx, [])
    ours = next(iter(conv.build(ctx, prepared, GGUFSpec(type="Q4_K_M"), tmp_path / "ours").files.values()))
    ref = tmp_path / "ref.gguf"
    tools = llama_cpp_toolchain(settings)
    subprocess.run([str(tools.exe("llama-quantize")), prepared.paths["base"], str(ref), "Q4_K_M", "2"],
                   check=True, env=tools.env(), capture_output=True)
    assert hashlib.sha256(ours.read_bytes()).digest() == hashlib.sha256(ref.read_bytes()).digest()


def test_unsupported_architecture_fails_early_and_names_supported(tmp_path: Path, demo_model: Path,
                                                                  settings: Settings) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    edit_config(ckpt, architectures=["LlamaForSequenceClassificationX"])
    conv = GGUFConverter(settings)
    with pytest.raises(UnsupportedArchitectureError) as info:
        conv.check(load_checkpoint(ckpt), [])
    assert "LlamaForCausalLM" in info.value.supported and "LlamaForCausalLM" in str(info.value)


def test_bytelevel_bpe_tokenizer_is_refused_clearly(tmp_path: Path, demo_model: Path, settings: Settings) -> None:
    ckpt = bytelevel_bpe_checkpoint(tmp_path / "bpe", demo_model)
    conv = GGUFConverter(settings)
    ctx = _ctx(ckpt, settings, name="bpe")
    with pytest.raises(TokenizerUnsupportedError, match="pre-tokenizer"):
        conv.prepare(ctx, [])
    assert not list((settings.work_root / "gguf-base").rglob("*.gguf"))
