"""The fast GGUF header reader (converters/gguf/header.py) against gguf-py's GGUFReader, the library it must agree
with: on the demo's base, its quantized types and split parts, on the real checkpoint's BF16 base and a type made
from it, and on small files gguf-py's writer makes (every value type, nested arrays, big-endian). The tokenizer
digest is the sha256 of the raw parts gguf-py parses for the ``tokenizer.*`` fields, equal across files whose
tokenizer metadata is equal and different when one token differs. Truncated or corrupt files raise
InvalidArtifactError."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFWriter

from converters.base import BuildContext
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import GGUFConverter, inspect_gguf
from converters.gguf.header import read_header
from converters.gguf.split import inspect_parts
from converters.source import resolve_source
from pipeline.config import Settings
from pipeline.errors import InvalidArtifactError
from pipeline.llama_cpp import llama_cpp_toolchain
from tests.conftest import make_settings
from tests.factories import truncate


def _ctx(ckpt_dir: Path, settings: Settings, name: str) -> BuildContext:
    return BuildContext(checkpoint=load_checkpoint(ckpt_dir), source=resolve_source(str(ckpt_dir),
                        cache_dir=settings.cache_dir), model_name=name, settings=settings)


def _reference_digest(reader: GGUFReader) -> str:
    """sha256 of the raw bytes gguf-py parsed for each ``tokenizer.*`` field (key, type, value), in key order."""
    digest = hashlib.sha256()
    for key in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
        digest.update(b"".join(part.tobytes() for part in reader.fields[key].parts))
    return digest.hexdigest()


def _reference_inspection(path: Path, reader: GGUFReader) -> dict[str, Any]:
    """What inspect_parts returned when it read files with gguf-py (one part)."""
    n_elements = sum(int(t.n_elements) for t in reader.tensors)
    size = path.stat().st_size
    return {"architecture": reader.get_field("general.architecture").contents(),
            "file_type": reader.get_field("general.file_type").contents(), "tensor_count": len(reader.tensors),
            "n_elements": n_elements, "size": size, "parts": 1, "bpw": round(size * 8 / n_elements, 4)}


def assert_agrees(path: Path) -> None:
    """The header of ``path`` says what gguf-py's reader says: every key's value (arrays: item type and
    length), every tensor's name, shape, type, data offset and size, and the tokenizer digest."""
    ours, ref = read_header(path), GGUFReader(str(path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in ours.arrays:  # item type and length as stored (gguf-py flattens nested arrays in .data)
            assert ours.arrays[key] == (int(field.parts[3][0]), int(field.parts[4][0])), key
        else:
            assert ours.fields[key] == field.contents(), key
    assert len(ours.fields) + len(ours.arrays) == len([k for k in ref.fields if not k.startswith("GGUF.")])
    assert [(t.name, t.shape, t.type, t.offset, t.n_bytes, t.n_elements) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes),
         int(t.n_elements)) for t in ref.tensors]
    assert ours.data_offset == ref.data_offset and ours.n_elements == sum(int(t.n_elements) for t in ref.tensors)
    assert ours.tokenizer_sha256 == _reference_digest(ref)


def test_header_agrees_with_gguf_py_on_the_demo(tmp_path: Path, demo_model: Path, settings: Settings) -> None:
    conv = GGUFConverter(settings)
    ctx = _ctx(demo_model, settings, "demo")
    base = Path(conv.prepare(ctx, []).paths["base"])
    out = tmp_path / "demo-Q4_K_M.gguf"
    tools = llama_cpp_toolchain(settings)
    subprocess.run([str(tools.exe("llama-quantize")), str(base), str(out), "Q4_K_M", "2"], check=True,
                   env=tools.env(), capture_output=True)
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    subprocess.run([str(tools.exe("llama-gguf-split")), "--split", "--split-max-size", "1M", str(out),
                    str(parts_dir / "demo-Q4_K_M")], check=True, env=tools.env(), capture_output=True)
    parts = sorted(parts_dir.glob("*.gguf"))
    assert len(parts) > 2
    for path in (base, out, *parts):
        assert_agrees(path)
    for path in (base, out):
        assert inspect_gguf(path) == _reference_inspection(path, GGUFReader(str(path)))
    split = inspect_parts(parts)
    assert split["tensor_count"] == len(GGUFReader(str(out)).tensors) and split["parts"] == len(parts)
    assert read_header(base).tokenizer_sha256 == read_header(out).tokenizer_sha256 == read_header(
        parts[0]).tokenizer_sha256


@pytest.mark.slow
def test_header_agrees_with_gguf_py_on_the_real_checkpoint(real_model: Path, cache_dir: Path,
                                                           tmp_path: Path) -> None:
    """SmolLM2-135M (49,152 tokens): the BF16 base the real-checkpoint tests convert into the shared work dir,
    and a Q2_K made from it."""
    cfg = make_settings(tmp_path / "registry", Settings(cache_dir=cache_dir).work_root, cache_dir)
    base = Path(GGUFConverter(cfg).prepare(_ctx(real_model, cfg, "smollm2-135m"), []).paths["base"])
    out = tmp_path / "smollm2-135m-Q2_K.gguf"
    tools = llama_cpp_toolchain(cfg)
    subprocess.run([str(tools.exe("llama-quantize")), str(base), str(out), "Q2_K", "2"], check=True,
                   env=tools.env(), capture_output=True)
    for path in (base, out):
        assert_agrees(path)
        assert inspect_gguf(path) == _reference_inspection(path, GGUFReader(str(path)))
    assert read_header(base).arrays["tokenizer.ggml.tokens"] == (8, 49152)
    assert read_header(base).tokenizer_sha256 == read_header(out).tokenizer_sha256


def _tiny(path: Path, tokens: list[str], *, name: str = "tiny", tokenizer_first: bool = True,
          endianess: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    """A small GGUF with every value type, a nested array, a vocabulary of ``tokens`` and two tensors."""
    writer = GGUFWriter(str(path), arch="llama", endianess=endianess)

    def tokenizer() -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([float(-i) for i in range(len(tokens))])
        writer.add_token_types([1] * len(tokens))
        writer.add_bos_token_id(1)

    if tokenizer_first:
        tokenizer()
    writer.add_name(name)
    writer.add_file_type(1)
    writer.add_uint8("test.u8", 7)
    writer.add_int8("test.i8", -7)
    writer.add_uint16("test.u16", 700)
    writer.add_int16("test.i16", -700)
    writer.add_int32("test.i32", -70000)
    writer.add_float32("test.f32", 0.5)
    writer.add_uint64("test.u64", 2**40)
    writer.add_int64("test.i64", -(2**40))
    writer.add_float64("test.f64", 0.25)
    writer.add_bool("test.bool", True)
    writer.add_array("test.floats", [0.5, 1.5, 2.5])
    writer.add_array("test.nested", [[1, 2, 3], [4, 5]])
    if not tokenizer_first:
        tokenizer()
    writer.add_tensor("token_embd.weight", np.ones((len(tokens), 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TOKENS = ["<unk>", "<s>", "</s>", "▁a", "▁b", "ab", "▁the", "é", "日本"]


def test_header_agrees_with_gguf_py_on_every_value_type(tmp_path: Path) -> None:
    little = _tiny(tmp_path / "little.gguf", TOKENS)
    big = _tiny(tmp_path / "big.gguf", TOKENS, endianess=GGUFEndian.BIG)
    for path in (little, big):
        assert_agrees(path)
    header = read_header(little)
    assert header.fields["test.u64"] == 2**40 and header.fields["test.bool"] is True
    assert header.arrays["test.nested"] == (9, 2) and header.arrays["test.floats"] == (6, 3)
    assert read_header(big).fields == header.fields and read_header(big).arrays == header.arrays


def test_tokenizer_digest_tells_tokenizers_apart(tmp_path: Path) -> None:
    one = read_header(_tiny(tmp_path / "one.gguf", TOKENS)).tokenizer_sha256
    # other metadata and another key order: the same tokenizer
    renamed = read_header(_tiny(tmp_path / "renamed.gguf", TOKENS, name="other", tokenizer_first=False))
    assert renamed.tokenizer_sha256 == one and renamed.fields["general.name"] == "other"
    edited = [*TOKENS[:-1], "日本語"]  # one token differs
    assert read_header(_tiny(tmp_path / "edited.gguf", edited)).tokenizer_sha256 != one
    swapped = [TOKENS[0], TOKENS[1], TOKENS[2], TOKENS[4], TOKENS[3], *TOKENS[5:]]  # same set, another order
    assert read_header(_tiny(tmp_path / "swapped.gguf", swapped)).tokenizer_sha256 != one


@pytest.mark.parametrize("where", ["tiny", "kv", "tensor_infos", "data"])
def test_truncated_file_is_an_invalid_artifact(where: str, tmp_path: Path) -> None:
    path = _tiny(tmp_path / "t.gguf", TOKENS)
    ref = GGUFReader(str(path))
    keep = {"tiny": 10, "kv": ref.fields["tokenizer.ggml.tokens"].offset + 40,
            "tensor_infos": ref.tensors[-1].field.offset + 5, "data": path.stat().st_size - 1}[where]
    truncate(path, keep)
    with pytest.raises(InvalidArtifactError, match=r"t\.gguf: .*truncated"):
        read_header(path)
    with pytest.raises(InvalidArtifactError):
        inspect_gguf(path)


def test_corrupt_header_is_an_invalid_artifact(tmp_path: Path) -> None:
    good = _tiny(tmp_path / "good.gguf", TOKENS)
    data = good.read_bytes()
    cases = {"magic": b"GGML" + data[4:], "version": data[:4] + (99).to_bytes(4, "little") + data[8:]}
    # the value type of the first key (after magic, version, counts, the key's length and name)
    key_len = int.from_bytes(data[24:32], "little")
    type_at = 32 + key_len
    cases["value type"] = data[:type_at] + (77).to_bytes(4, "little") + data[type_at + 4:]
    for label, content in cases.items():
        bad = tmp_path / f"{label.replace(' ', '-')}.gguf"
        bad.write_bytes(content)
        with pytest.raises(InvalidArtifactError, match=bad.name) as info:
            read_header(bad)
        assert {"magic": "bad magic", "version": "version 99", "value type": "unknown value type 77"}[label] in str(
            info.value)
    empty = tmp_path / "empty.gguf"
    shutil.copyfile(good, empty)
    truncate(empty, 0)
    with pytest.raises(InvalidArtifactError, match="too short"):
        read_header(empty)
