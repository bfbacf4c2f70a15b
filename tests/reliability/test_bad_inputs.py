"""A corpus of bad inputs, generated here. Each must give a typed error with a clear message (what was
expected, what to do), exit code 2, and leave the registry byte-for-byte unchanged (DB dump + blob list)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from typer.testing import CliRunner

from pipeline.cli import app
from tests.conftest import registry_snapshot
from tests.factories import bytelevel_bpe_checkpoint, copy_checkpoint, edit_config, truncate

Make = Callable[[Path, Path], Path]


def _copy(tmp: Path, demo: Path) -> Path:
    return copy_checkpoint(demo, tmp / "m")


def _rewrite_header(ckpt: Path, mutate: Callable[[dict], None]) -> Path:
    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    mutate(header)
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])
    return ckpt


def _set_values(ckpt: Path, value: float) -> Path:
    path = ckpt / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][3, 7] = value
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return ckpt


def _drop_tensor(ckpt: Path, name: str) -> Path:
    path = ckpt / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    del tensors[name]
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return ckpt


def _sharded_index(ckpt: Path, shard_name: str) -> Path:
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    weight_map = {k: "model-00001-of-00001.safetensors" for k in _names(ckpt / "model-00001-of-00001.safetensors")}
    first = next(iter(weight_map))
    weight_map[first] = shard_name
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ckpt


def _names(path: Path) -> list[str]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]


def _renamed(ckpt: Path, old: str, new: str) -> Path:
    (ckpt / old).rename(ckpt / new)
    return ckpt


def _without(ckpt: Path, *names: str) -> Path:
    for name in names:
        (ckpt / name).unlink()
    return ckpt


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _file_instead_of_folder(tmp: Path, demo: Path) -> Path:
    f = tmp / "model.safetensors"
    f.write_bytes((demo / "model.safetensors").read_bytes()[:1000])
    return f


def _outside_link(tmp: Path, demo: Path) -> Path:
    ckpt = _copy(tmp, demo)
    (tmp / "secret.json").write_text("{}")
    os.symlink(tmp / "secret.json", ckpt / "extra.json")
    return ckpt


def _header_len(ckpt: Path, n: int) -> Path:
    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", n) + raw[8:])
    return ckpt


def _tensor_with_dtype(ckpt: Path, dtype: str) -> Path:
    def mutate(h: dict) -> None:
        h["lm_head.weight"]["dtype"] = dtype
    return _rewrite_header(ckpt, mutate)


CONVERT_CASES: dict[str, tuple[Make, str, str]] = {
    "missing-path": (lambda t, d: t / "nope", "SourceNotFoundError", "does not exist"),
    "file-not-folder": (_file_instead_of_folder, "InvalidCheckpointError", "is a file"),
    "empty-folder": (lambda t, d: (t / "empty").mkdir() or t / "empty", "InvalidCheckpointError", "no config.json"),
    "no-config": (lambda t, d: (_copy(t, d) / "config.json").unlink() or t / "m", "InvalidCheckpointError",
                  "config.json"),
    "config-not-json": (lambda t, d: (_copy(t, d) / "config.json").write_text("{nope") and t / "m",
                        "InvalidCheckpointError", "not valid JSON"),
    "config-no-model-type": (lambda t, d: (_copy(t, d) / "config.json").write_text("[1, 2]") and t / "m",
                             "InvalidCheckpointError", "model_type"),
    "unknown-model-type": (lambda t, d: edit_config(_copy(t, d), model_type="zebra") or t / "m",
                           "UnsupportedArchitectureError", "zebra"),
    "unsupported-architecture": (lambda t, d: edit_config(_copy(t, d), architectures=["LlamaForZebras"]) or t / "m",
                                 "UnsupportedArchitectureError", "LlamaForZebras"),
    "remote-code": (lambda t, d: edit_config(_copy(t, d), auto_map={"AutoModel": "x.Y"}) or t / "m",
                    "UnsafeSourceError", "remote code"),
    "no-weights": (lambda t, d: (_copy(t, d) / "model.safetensors").unlink() or t / "m", "InvalidCheckpointError",
                   "no weights"),
    "pickle-weights": (lambda t, d: _renamed(_copy(t, d), "model.safetensors", "pytorch_model.bin"),
                       "UnsafeSourceError", "--allow-pickle"),
    "truncated-half": (lambda t, d: truncate(_copy(t, d) / "model.safetensors", 10_000_000) or t / "m",
                       "InvalidCheckpointError", "truncated"),
    "truncated-in-header": (lambda t, d: truncate(_copy(t, d) / "model.safetensors", 100) or t / "m",
                            "InvalidCheckpointError", "header"),
    "shorter-than-8-bytes": (lambda t, d: truncate(_copy(t, d) / "model.safetensors", 5) or t / "m",
                             "InvalidCheckpointError", "too short"),
    "empty-weights-file": (lambda t, d: truncate(_copy(t, d) / "model.safetensors", 0) or t / "m",
                           "InvalidCheckpointError", "empty"),
    "garbage-header-length": (lambda t, d: _header_len(_copy(t, d), 2**60), "InvalidCheckpointError", "header"),
    "header-not-json": (lambda t, d: _header_len(_copy(t, d), 16), "InvalidCheckpointError", "not valid JSON"),
    "header-huge-shape": (lambda t, d: _rewrite_header(_copy(t, d), lambda h: h["lm_head.weight"].update(
        shape=[4_000_000_000, 4_000_000_000])), "InvalidCheckpointError", "needs"),
    "header-unknown-dtype": (lambda t, d: _tensor_with_dtype(_copy(t, d), "Q4"), "InvalidCheckpointError",
                             "unknown dtype"),
    "header-negative-dim": (lambda t, d: _rewrite_header(_copy(t, d), lambda h: h["lm_head.weight"].update(
        shape=[-1, 256])), "InvalidCheckpointError", "negative"),
    "nan-weights": (lambda t, d: _set_values(_copy(t, d), float("nan")), "InvalidCheckpointError", "NaN/Inf"),
    "inf-weights": (lambda t, d: _set_values(_copy(t, d), float("inf")), "InvalidCheckpointError", "NaN/Inf"),
    "shape-vs-config": (lambda t, d: edit_config(_copy(t, d), intermediate_size=1024) or t / "m",
                        "InvalidCheckpointError", "config.json implies"),
    "vocab-vs-config": (lambda t, d: edit_config(_copy(t, d), vocab_size=5000) or t / "m",
                        "InvalidCheckpointError", "config.json implies"),
    "missing-tensor": (lambda t, d: _drop_tensor(_copy(t, d), "model.layers.2.self_attn.q_proj.weight"),
                       "InvalidCheckpointError", "missing"),
    "missing-tokenizer": (lambda t, d: _without(_copy(t, d), "tokenizer.model", "tokenizer.json"),
                          "InvalidCheckpointError", "no tokenizer"),
    "corrupt-tokenizer": (lambda t, d: [(_copy(t, d) / "tokenizer.json").write_text("{broken"),
                                        (t / "m" / "tokenizer.model").write_bytes(b"\x00garbage")] and t / "m",
                          "InvalidCheckpointError", "tokenizer"),
    "bpe-unknown-pretokenizer": (lambda t, d: bytelevel_bpe_checkpoint(t / "bpe", d), "TokenizerUnsupportedError",
                                 "pre-tokenizer"),
    "symlink-outside": (_outside_link, "UnsafeSourceError", "outside the checkpoint"),
    "index-dotdot-shard": (lambda t, d: _sharded_index(_copy(t, d), "../evil.safetensors"), "UnsafeSourceError",
                           "not a plain file name"),
    "index-absolute-shard": (lambda t, d: _sharded_index(_copy(t, d), "/etc/passwd"), "UnsafeSourceError",
                             "not a plain file name"),
    "index-missing-shard": (lambda t, d: _sharded_index(_copy(t, d), "model-00002-of-00002.safetensors"),
                            "InvalidCheckpointError", "missing"),
    "index-empty-map": (lambda t, d: (_copy(t, d) / "model.safetensors.index.json").write_text(
        '{"weight_map": {}}') and t / "m", "InvalidCheckpointError", "empty weight_map"),
    # the checkpoint's own evaluation text, and a context shorter than the default window of 512
    "eval-txt-not-utf8": (lambda t, d: (_copy(t, d) / "eval.txt").write_bytes("café".encode("latin-1")) and t / "m",
                          "ConfigError", "is not UTF-8 text"),
    "eval-txt-too-short": (lambda t, d: (_copy(t, d) / "eval.txt").write_text("too short") and t / "m",
                           "InvalidSpecError", "fewer than one window"),
    "context-below-window": (lambda t, d: edit_config(_copy(t, d), max_position_embeddings=256) or t / "m",
                             "InvalidSpecError", "was made for: 256 positions"),
}


@pytest.fixture
def snapshot_registry(demo_registry: Path) -> Path:
    return demo_registry


@pytest.mark.parametrize("case", sorted(CONVERT_CASES))
def test_bad_source(case: str, tmp_path: Path, demo_model: Path, snapshot_registry: Path,
                    prefect_harness: None) -> None:
    make, error_type, needle = CONVERT_CASES[case]
    source = make(tmp_path, demo_model)
    before = registry_snapshot(snapshot_registry)
    result = CliRunner().invoke(app, ["convert", str(source), "--gguf", "Q8_0", "--name", "demo", "--no-speed",
                                      "--registry", str(snapshot_registry)])
    assert result.exit_code == 2, result.output
    assert error_type in result.output, result.output
    assert needle.lower() in result.output.lower(), result.output
    assert "→" in result.output, "the message must say what to do"
    assert registry_snapshot(snapshot_registry) == before


USAGE_CASES: dict[str, tuple[list[str], str]] = {
    "unknown-gguf-type": (["--gguf", "Q4_K_XXL"], "UnknownQuantTypeError"),
    "bad-exl2-bpw": (["--exl2", "9.5"], "InvalidSpecError"),
    "bad-model-name": (["--gguf", "Q8_0", "--name", "../evil"], "InvalidSpecError"),
    "no-variants": ([], "InvalidSpecError"),
    "window-beyond-context": (["--gguf", "Q8_0", "--window", "4096"], "InvalidSpecError"),
}


@pytest.mark.parametrize("case", sorted(USAGE_CASES))
def test_bad_usage(case: str, demo_model: Path, snapshot_registry: Path, prefect_harness: None) -> None:
    args, error_type = USAGE_CASES[case]
    before = registry_snapshot(snapshot_registry)
    result = CliRunner().invoke(app, ["convert", str(demo_model), *args, "--registry", str(snapshot_registry)])
    assert result.exit_code == 2 and error_type in result.output, result.output
    assert registry_snapshot(snapshot_registry) == before


def _gguf(snapshot_registry: Path, tmp: Path) -> Path:
    from registry import open_registry

    (path,) = open_registry(str(snapshot_registry)).pull("demo/Q8_0", tmp / "pr")
    return path


def _bad_magic(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))


def _awq_missing_field(tmp: Path) -> Path:
    folder = tmp / "awq"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128}}))
    safetensors.numpy.save_file({"x": np.zeros((2, 2), dtype="float16")}, str(folder / "model.safetensors"))
    return folder


ARTIFACT_CASES: dict[str, tuple[Callable[[Path, Path], Path], str, str]] = {
    "gguf-bad-magic": (lambda reg, t: (_bad_magic(p := _gguf(reg, t)), p)[1], "InvalidArtifactError", "bad magic"),
    "gguf-truncated-tensors": (lambda reg, t: (truncate(p := _gguf(reg, t), p.stat().st_size - 4096), p)[1],
                               "InvalidArtifactError", "truncated"),
    "gguf-empty": (lambda reg, t: (t / "x.gguf").write_bytes(b"") or t / "x.gguf", "InvalidArtifactError",
                   "bad magic"),
    "awq-missing-field": (lambda reg, t: _awq_missing_field(t), "InvalidArtifactError", "zero_point"),
    "not-a-quant": (lambda reg, t: _written(t / "notes.txt", "hi"), "InvalidSpecError", "neither a GGUF"),
}


@pytest.mark.parametrize("case", sorted(ARTIFACT_CASES))
def test_bad_artifact_for_validate(case: str, tmp_path: Path, demo_model: Path, snapshot_registry: Path) -> None:
    make, error_type, needle = ARTIFACT_CASES[case]
    target = make(snapshot_registry, tmp_path)
    before = registry_snapshot(snapshot_registry)
    result = CliRunner().invoke(app, ["validate", str(target), "--source", str(demo_model),
                                      "--registry", str(snapshot_registry)])
    assert result.exit_code == 2, result.output
    assert error_type in result.output and needle in result.output, result.output
    assert registry_snapshot(snapshot_registry) == before


def test_validate_refuses_windows_beyond_the_sources_context(tmp_path: Path, demo_model: Path,
                                                             snapshot_registry: Path) -> None:
    target = _gguf(snapshot_registry, tmp_path)
    result = CliRunner().invoke(app, ["validate", str(target), "--source", str(demo_model), "--window", "4096",
                                      "--registry", str(snapshot_registry)])
    assert result.exit_code == 2, result.output
    assert "InvalidSpecError" in result.output and "was made for: 2048 positions" in result.output, result.output


def test_corpus_size() -> None:
    assert len(CONVERT_CASES) + len(USAGE_CASES) + len(ARTIFACT_CASES) >= 30
