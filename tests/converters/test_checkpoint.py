from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from converters.checkpoint import Checkpoint, content_hash, load_checkpoint, read_safetensors_header, scan_nonfinite
from pipeline.errors import (
    InvalidCheckpointError,
    SourceNotFoundError,
    UnsafeSourceError,
    UnsupportedArchitectureError,
)
from tests.factories import arch_checkpoint, copy_checkpoint, edit_config, truncate


def test_demo_checkpoint_is_valid(demo_model: Path) -> None:
    ckpt = load_checkpoint(demo_model)
    assert ckpt.architecture == "LlamaForCausalLM"
    assert ckpt.config["hidden_size"] % 256 == 0 and ckpt.config["intermediate_size"] % 256 == 0
    assert (demo_model / "tokenizer.model").is_file()
    assert ckpt.n_params > 1_000_000


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(InvalidCheckpointError, match=r"no config\.json"):
        load_checkpoint(tmp_path)


def test_truncated_safetensors(tmp_path: Path, demo_model: Path) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    weights = ckpt / "model.safetensors"
    truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(InvalidCheckpointError, match="truncated"):
        load_checkpoint(ckpt)


def test_unknown_model_type(tmp_path: Path, demo_model: Path) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    edit_config(ckpt, model_type="llamazilla")
    with pytest.raises(UnsupportedArchitectureError, match="llamazilla"):
        load_checkpoint(ckpt)


def test_shapes_must_match_config(tmp_path: Path, demo_model: Path) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    edit_config(ckpt, hidden_size=512)
    with pytest.raises(InvalidCheckpointError, match=r"config\.json implies"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize(("arch", "stored", "loaded"), [
    ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.mlp.experts.gate_up_proj"),
    ("gpt_neox", "embed_out.weight", "lm_head.weight"),
])
def test_weights_that_transformers_fuses_or_renames_as_it_loads_are_found(tmp_path: Path, demo_model: Path,
                                                                         arch: str, stored: str, loaded: str) -> None:
    """Checkpoints hold the names save_pretrained writes, not those of the model transformers 5 builds (per-expert
    linears it fuses; GPT-NeoX's ``embed_out``): a complete Mixtral or Pythia is not 'incomplete'."""
    ckpt = arch_checkpoint(tmp_path / arch, demo_model, arch, layers=1)
    tensors = load_checkpoint(ckpt).tensors
    assert stored in tensors and loaded not in tensors


def test_a_moe_checkpoint_without_one_expert_is_incomplete(tmp_path: Path, demo_model: Path) -> None:
    import safetensors.torch

    ckpt = arch_checkpoint(tmp_path / "mixtral", demo_model, "mixtral", layers=1)
    weights = safetensors.torch.load_file(ckpt / "model.safetensors")
    del weights["model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    safetensors.torch.save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidCheckpointError,
                       match=r"^1 tensors .* missing, e\.g\. model\.layers\.0\.block_sparse_moe\.experts\.1\.w2"):
        load_checkpoint(ckpt)


def test_names_saved_from_the_base_model_are_complete_and_a_missing_one_is_still_found(tmp_path: Path,
                                                                                      demo_model: Path) -> None:
    """Tensor names without the base model's prefix (``layers.0...``, not ``model.layers.0...``), as a checkpoint
    saved from GPT2Model is stored and as transformers loads into the causal LM: the check took a GPT-2 so
    stored for 16 missing tensors. The output head, outside the base model, keeps its name."""
    import safetensors.torch

    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    weights = {k.removeprefix("model."): v for k, v in safetensors.torch.load_file(ckpt / "model.safetensors").items()}
    assert "lm_head.weight" in weights and "layers.0.self_attn.q_proj.weight" in weights
    safetensors.torch.save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert "embed_tokens.weight" in load_checkpoint(ckpt).tensors
    del weights["layers.1.mlp.up_proj.weight"]
    safetensors.torch.save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidCheckpointError, match=r"^1 tensors .* missing, e\.g\. layers\.1\.mlp\.up_proj"):
        load_checkpoint(ckpt)


def test_parameters_are_counted_as_transformers_counts_them(tmp_path: Path, demo_model: Path) -> None:
    """Buffers saved beside the weights (Llama checkpoints of transformers < 4.31 hold each layer's
    ``rotary_emb.inv_freq``, the Hub's GPT-2 its causal masks) and a stored copy of a tied weight are not
    parameters: bpw is bits over this count, and a GPT-2 so stored was counted 10 % larger."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    want = AutoModelForCausalLM.from_pretrained(ckpt).num_parameters()
    assert load_checkpoint(ckpt).n_params == want
    weights = safetensors.torch.load_file(ckpt / "model.safetensors")
    for i in range(json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]):
        weights[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4096)
    safetensors.torch.save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    loaded = load_checkpoint(ckpt)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in loaded.unused
    assert loaded.n_params == want == AutoModelForCausalLM.from_pretrained(ckpt).num_parameters()
    assert load_checkpoint(ckpt, check_shapes=False).n_params > want  # what the count was without the check


def test_model_safetensors_is_the_model_as_transformers_reads_it(tmp_path: Path, demo_model: Path) -> None:
    """Mistral's repos ship consolidated.safetensors (the same weights under mistral-inference's names) beside
    the transformers files; without an index, transformers loads model.safetensors only, and so do we."""
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    safetensors.numpy.save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)},
                                str(ckpt / "consolidated.safetensors"))
    loaded = load_checkpoint(ckpt)
    assert [f.name for f in loaded.weight_files] == ["model.safetensors"]
    assert "layers.0.attention.wq.weight" not in loaded.tensors
    assert loaded.n_params == load_checkpoint(demo_model).n_params


def test_a_config_without_a_dtype_takes_the_stored_weights_dtype(tmp_path: Path, demo_model: Path) -> None:
    """A bf16 checkpoint whose config.json says no dtype was read as float32 (its GGUF base became F16)."""
    from converters.gguf.converter import choose_base_type

    ckpt = arch_checkpoint(tmp_path / "bf16", demo_model, "llama", layers=1, dtype="bfloat16")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg.pop("dtype", None) == "bfloat16" and "torch_dtype" not in cfg
    (ckpt / "config.json").write_text(json.dumps(cfg))
    loaded = load_checkpoint(ckpt)
    assert (loaded.torch_dtype, loaded.stored_dtype, choose_base_type(loaded)) == ("bfloat16", "bfloat16", "BF16")
    edit_config(ckpt, torch_dtype="float16")  # what the config says wins, as transformers reads it
    assert load_checkpoint(ckpt).torch_dtype == "float16"
    assert load_checkpoint(demo_model).stored_dtype == "float32"


@pytest.mark.parametrize(("config", "expected"), [
    ({"model_type": "llama", "max_position_embeddings": 2048}, (2048, "max_position_embeddings")),
    ({"model_type": "gpt2", "n_positions": 1024}, (1024, "n_positions")),  # GPT-2 as saved: learned positions
    # Llama-3.1: the stated length already includes the scaling of its shorter original context
    ({"model_type": "llama", "max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}},
     (131072, "max_position_embeddings")),
    # Qwen2.5 with the YaRN block its model cards say to add: the stated length is the original one
    ({"model_type": "qwen2", "max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 32768}}, (131072, "max_position_embeddings × rope factor 4")),
    ({"model_type": "gemma3", "text_config": {"max_position_embeddings": 131072}}, (131072, "max_position_embeddings")),
    ({"model_type": "bloom"}, None),  # ALiBi: no stated length
])
def test_the_trained_context_is_what_config_json_states(config: dict[str, object],
                                                         expected: tuple[int, str] | None) -> None:
    assert Checkpoint(path=Path("x"), config=config).trained_context == expected


def test_a_config_without_architectures_is_refused_naming_the_class_to_add(tmp_path: Path, demo_model: Path) -> None:
    """llama.cpp's converter stops on it ("Failed to detect model architecture"); the check says what to add."""
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["architectures"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidCheckpointError, match="has no 'architectures'") as info:
        load_checkpoint(ckpt)
    assert '"architectures": ["LlamaForCausalLM"]' in str(info.value.hint)


def test_remote_code_refused(tmp_path: Path, demo_model: Path) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    edit_config(ckpt, auto_map={"AutoModelForCausalLM": "modeling_x.X"})
    with pytest.raises(UnsafeSourceError, match="remote code"):
        load_checkpoint(ckpt)


def test_pickle_weights_refused_unless_allowed(tmp_path: Path, demo_model: Path) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(UnsafeSourceError, match="--allow-pickle"):
        load_checkpoint(ckpt)
    assert load_checkpoint(ckpt, allow_pickle=True, check_shapes=False).weight_files[0].name == "pytorch_model.bin"


def test_symlink_outside_refused(tmp_path: Path, demo_model: Path) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    os.symlink(outside, ckpt / "generation_config.json.link")
    with pytest.raises(UnsafeSourceError, match="outside the checkpoint"):
        load_checkpoint(ckpt)


def test_missing_tokenizer(tmp_path: Path, demo_model: Path) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    for name in ("tokenizer.model", "tokenizer.json"):
        (ckpt / name).unlink()
    with pytest.raises(InvalidCheckpointError, match="no tokenizer"):
        load_checkpoint(ckpt)


def test_content_hash_changes_with_content(tmp_path: Path, demo_model: Path) -> None:
    ckpt = copy_checkpoint(demo_model, tmp_path / "m")
    before = content_hash(ckpt)
    assert before == content_hash(demo_model)
    (ckpt / "extra.txt").write_text("x")
    assert content_hash(ckpt) != before


def test_content_hash_is_its_definition_on_any_number_of_threads(tmp_path: Path) -> None:
    """A source's identity is sha256 over "relative path NUL size NUL file sha256 LF" of its files in sorted
    order (dot files and dot/cache folders left out): registries hold it, so it must not move, whether the
    shards are read one after another or at once."""
    import hashlib

    root = tmp_path / "src"
    files = {"config.json": b"{}", "model-00001-of-00003.safetensors": os.urandom(3 << 20),
             "model-00002-of-00003.safetensors": os.urandom(1 << 20), "model-00003-of-00003.safetensors": b"",
             "sub/tokenizer.json": b"tok", "sub/deeper/a.txt": b"a"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    for ignored in (".hidden", ".git/HEAD", "__pycache__/x.pyc", ".cache/huggingface/y"):
        (root / ignored).parent.mkdir(parents=True, exist_ok=True)
        (root / ignored).write_bytes(b"left out")
    # os.walk's order: a folder's files (sorted), then its folders (sorted), depth first
    order = ["config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
             "model-00003-of-00003.safetensors", "sub/tokenizer.json", "sub/deeper/a.txt"]
    want = hashlib.sha256("".join(f"{rel}\0{len(files[rel])}\0{hashlib.sha256(files[rel]).hexdigest()}\n"
                                  for rel in order).encode()).hexdigest()
    assert {content_hash(root, workers=n) for n in (1, 2, 8)} == {want}
    assert content_hash(root) == want


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(["bfloat16", "float16", "float32", "float64"]),
       shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
       bad=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]),
       extreme=st.booleans(), where=st.integers(0, 10_000), chunk=st.sampled_from([1, 5, 1 << 25]))
def test_scan_refuses_exactly_the_nonfinite_values(tmp_path_factory: pytest.TempPathFactory, dtype: str,
                                                   shape: list[int], bad: float | None, extreme: bool, where: int,
                                                   chunk: int) -> None:
    """One NaN or infinity anywhere in a tensor of any float dtype and shape (empty and 0-d included), in chunks of
    one row or more, is refused and counted; the dtype's largest finite values pass."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("scan")
    t = torch.randn(shape, dtype=torch.float64).to(getattr(torch, dtype))
    n = t.numel()
    if extreme and n:
        t.view(-1)[(where + 1) % n] = torch.finfo(t.dtype).max
        t.view(-1)[(where + 2) % n] = torch.finfo(t.dtype).min
    if bad is not None and n:
        t.view(-1)[where % n] = bad
    save_file({"w": t, "ones": torch.ones(4, 3)}, str(folder / "model.safetensors"))
    ckpt = Checkpoint(path=folder, config={}, tensors=read_safetensors_header(folder / "model.safetensors"),
                      weight_files=[folder / "model.safetensors"])
    if bad is None or n == 0:
        scan_nonfinite(ckpt, chunk_elements=chunk)
    else:
        with pytest.raises(InvalidCheckpointError, match=r"tensor w in model.safetensors holds 1 NaN/Inf values"):
            scan_nonfinite(ckpt, chunk_elements=chunk)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3), min_size=1, max_size=5),
       dtype=st.sampled_from(["float32", "float16", "int8", "int64"]))
def test_header_parser_agrees_with_safetensors(tmp_path_factory: pytest.TempPathFactory, shapes: list[list[int]],
                                               dtype: str) -> None:
    """Our header check accepts exactly what the safetensors library writes, with the same shapes."""
    path = tmp_path_factory.mktemp("st") / "t.safetensors"
    tensors = {f"t{i}": np.zeros(s, dtype=dtype) for i, s in enumerate(shapes)}
    safetensors.numpy.save_file(tensors, str(path))
    ours = read_safetensors_header(path)
    with safetensors.safe_open(str(path), "np") as f:
        theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert {k: v.shape for k, v in ours.items()} == theirs


def test_header_parser_rejects_what_safetensors_rejects(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    safetensors.numpy.save_file({"a": np.ones((4, 4), dtype="float32")}, str(path))
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["a"]["shape"] = [400000, 400000]  # a header claiming a huge shape
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])
    with pytest.raises(InvalidCheckpointError):
        read_safetensors_header(path)
    with pytest.raises(Exception):  # noqa: B017 - the library raises its own error type
        safetensors.numpy.load_file(str(path))
