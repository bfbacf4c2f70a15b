from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import GGUFConverter, converted_directly, inspect_gguf
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


def test_float_types_the_base_cannot_hold_exactly_are_converted_from_the_checkpoint(
        tmp_path: Path, demo_model: Path, settings: Settings) -> None:
    """The demo is fp32, so its base is F16. Made from that base, its "F32" held F16's rounding of every weight
    (found: 6e-5 off the source on a tiny model) and its BF16 a second rounding of it: not what F32 or BF16
    means in llama.cpp's tables. They are converted from the checkpoint; F16 is still the base itself."""
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    conv = GGUFConverter(settings)
    ctx = _ctx(demo_model, settings)
    prepared = conv.prepare(ctx, [])
    assert prepared.meta["base_type"] == "F16"
    source = load_file(str(demo_model / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]

    def weight(built: object) -> np.ndarray:
        path = next(iter(built.files.values()))  # type: ignore[attr-defined]
        tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
        data = np.asarray(tensor.data)  # BF16 comes as its bytes
        return (data.view(np.int16) if data.dtype == np.uint8 else data).reshape(source.shape)

    f32 = conv.build(ctx, prepared, GGUFSpec(type="F32"), tmp_path / "F32")
    assert np.array_equal(weight(f32), source)  # every bit of the source
    assert f32.parameters["base_type"] == "F32" and f32.events == ["convert"]
    assert conv.build(ctx, prepared, GGUFSpec(type="F32"), tmp_path / "F32-again").events == []  # cached
    assert conv.build_inputs(ctx, GGUFSpec(type="F32")) == {"converted_directly": True}
    bf16 = conv.build(ctx, prepared, GGUFSpec(type="BF16"), tmp_path / "BF16")
    once = torch.from_numpy(source).to(torch.bfloat16).view(torch.int16).numpy()  # one rounding, as torch does it
    assert np.array_equal(weight(bf16), once)
    f16 = conv.build(ctx, prepared, GGUFSpec(type="F16"), tmp_path / "F16")
    assert f16.parameters["base_type"] == "F16" and f16.events == []
    assert conv.build_inputs(ctx, GGUFSpec(type="F16")) == {}
    f16_file = next(iter(f16.files.values()))
    assert f16_file.read_bytes() == Path(prepared.paths["base"]).read_bytes()
    # what the weights are decides, not what config.json says: fp32 weights under "float16" are still fp32
    said_f16 = copy_checkpoint(demo_model, tmp_path / "said-f16")
    edit_config(said_f16, torch_dtype="float16")
    assert converted_directly(load_checkpoint(said_f16), "F16", GGUFSpec(type="F32"))
    assert not converted_directly(load_checkpoint(said_f16), "F32", GGUFSpec(type="F16"))


def test_a_bf16_sources_float_types_come_from_its_bf16_base(real_model: Path) -> None:
    """A BF16 base holds a bf16 source exactly, so F16 and F32 are made from it (one rounding, or none). Its
    dtype's name contains "float16": the first version of the rule matched it as fp16 and converted F16 anew."""
    ckpt = load_checkpoint(real_model)
    assert ckpt.stored_dtype == "bfloat16"
    for t in ("F16", "F32", "BF16"):
        assert not converted_directly(ckpt, "BF16", GGUFSpec(type=t)), t
    assert converted_directly(ckpt, "F16", GGUFSpec(type="BF16"))  # --gguf-base f16 does not hold it


#: llama.cpp's library call, as the quantize worker made it before it ran the llama-quantize binary
LIBRARY_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def test_quantize_is_byte_identical_to_llama_model_quantize_and_llama_quantize(tmp_path: Path, demo_model: Path,
                                                                               settings: Settings) -> None:
    conv = GGUFConverter(settings)
    ctx = _ctx(demo_model, settings)
    prepared = conv.prepare(ctx, [])
    tools = llama_cpp_toolchain(settings)
    for t in ("Q8_0", "Q4_K_M", "Q2_K"):
        spec = GGUFSpec(type=t)
        ours = next(iter(conv.build(ctx, prepared, spec, tmp_path / t).files.values()))
        library, binary = tmp_path / f"library-{t}.gguf", tmp_path / f"binary-{t}.gguf"
        subprocess.run([sys.executable, "-c", LIBRARY_QUANTIZE, prepared.paths["base"], str(library),
                        str(spec.file_type)], check=True, env=tools.env(), capture_output=True)
        subprocess.run([str(tools.exe("llama-quantize")), prepared.paths["base"], str(binary), t, "2"],
                       check=True, env=tools.env(), capture_output=True)
        digests = {hashlib.sha256(p.read_bytes()).hexdigest() for p in (ours, library, binary)}
        assert len(digests) == 1, t


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
