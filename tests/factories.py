"""Builders for test checkpoints: copies of the demo checkpoint with one thing broken, and small
random-weight checkpoints of other architectures / tokenizers. All local, no downloads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_checkpoint(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def edit_config(ckpt: Path, **changes: Any) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def random_checkpoint(dest: Path, tokenizer_from: Path, *, model_type: str = "llama", hidden: int = 256,
                      intermediate: int = 512, layers: int = 2, dtype: str = "float32", tie: bool = False,
                      max_shard_size: str | None = None, seed: int = 0, vocab_size: int | None = None,
                      kv_heads: int = 2, **extra: Any) -> Path:
    """A randomly initialised causal LM of ``model_type`` with the demo tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    tok_cfg = json.loads((tokenizer_from / "config.json").read_text())
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size or tok_cfg["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **extra)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(dest, **kwargs)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, dest / name)
    return dest


def bytelevel_bpe_checkpoint(dest: Path, demo: Path) -> Path:
    """A Llama whose tokenizer is a freshly trained ByteLevel BPE with a pre-tokenizer llama.cpp does not
    know: the converter must refuse it (it cannot guarantee token parity)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (demo / "eval.txt").read_text()[:200_000].splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    random_checkpoint(dest, demo, layers=1, vocab_size=len(fast))
    for name in TOKENIZER_FILES:
        (dest / name).unlink(missing_ok=True)
    fast.save_pretrained(dest)
    return dest


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


# --- other architectures ------------------------------------------------------------------------

#: Per-architecture settings for tiny random checkpoints that llama.cpp's converter and loader accept
#: with the demo SentencePiece tokenizer (hidden and FFN sizes stay multiples of 256 for K-quants).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral"},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 64},
    # Gemma ties its embeddings (llama.cpp drops lm_head.weight for it) and its tokenizer adds no dummy
    # prefix space; GemmaTokenizer is what Gemma repos declare.
    "gemma": {"model_type": "gemma", "head_dim": 64, "tokenizer_class": "GemmaTokenizer", "tie": True},
    # llama.cpp's Phi-3 vocabulary loader looks up Phi-3's own special tokens by name.
    "phi3": {"model_type": "phi3", "pad_token_id": 0,
             "special_tokens": ["<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>"]},
    # transformers 5 fuses each MoE layer's experts into one 3-D parameter as it loads them; on disk (and as
    # save_pretrained writes them) they stay one linear per expert, ``block_sparse_moe.experts.N.w1``.
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    # stored as ``embed_out``, loaded as ``lm_head`` (a renaming in transformers 5's conversion mapping);
    # rotary_pct as Pythia's config spells it; transformers 5 saves it as rope_parameters.partial_rotary_factor
    # (llama.cpp's converter is given it back: converters/gguf/converter.py converter_config).
    "gpt_neox": {"model_type": "gpt_neox", "rotary_pct": 0.25},
    # GPT-2: transformers 5 saves n_positions only, where llama.cpp's converter reads n_ctx
    "gpt2": {"model_type": "gpt2"},
    # an architecture ExLlamaV2 does not know (it would load it as a Llama)
    "falcon": {"model_type": "falcon"},
    # Phi-2's shapes: no grouped K/V heads and an FFN 4 × hidden wide, which llama.cpp's converter writes
    # whatever intermediate_size says; its BPE tokenizer must be one llama.cpp knows (the real checkpoint's)
    "phi": {"model_type": "phi", "partial_rotary_factor": 0.5, "kv_heads": 4, "intermediate": 1024},
    # others llama.cpp converts, each with the real checkpoint's BPE tokenizer: StableLM (partial rotary,
    # LayerNorm), OLMo 2 (norms after attention and MLP, Q/K norms), Granite (its own multipliers, as
    # granite-3.x sets them), Qwen2-MoE (routed and shared experts), OLMoE (Q/K norms over all heads, which
    # llama.cpp's olmoe expects: no grouped K/V heads)
    "stablelm": {"model_type": "stablelm"},
    "olmo2": {"model_type": "olmo2"},
    "granite": {"model_type": "granite", "attention_multiplier": 0.125, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22, "logits_scaling": 4.0},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256},
    "olmoe": {"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2, "kv_heads": 4},
    # DeepSeek-V3's multi-head latent attention and sigmoid-gated routed experts (plus a shared one), every
    # layer routed (first_k_dense_replace 0); transformers 5 writes no scoring_func (its router is always sigmoid)
    "deepseek_v3": {"model_type": "deepseek_v3", "kv_lora_rank": 64, "q_lora_rank": 128, "qk_rope_head_dim": 32,
                    "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 0, "moe_intermediate_size": 256, "n_group": 1, "topk_group": 1,
                    "kv_heads": 4},
}


def arch_checkpoint(dest: Path, demo: Path, arch: str, **kw: Any) -> Path:
    """A tiny random checkpoint of ``arch`` (see :data:`ARCHITECTURES`) with the demo tokenizer."""
    settings = {**ARCHITECTURES[arch], **kw}
    special = settings.pop("special_tokens", None)
    tokenizer_class = settings.pop("tokenizer_class", None)
    tokenizer_from = demo
    if special or tokenizer_class:
        tokenizer_from = _custom_tokenizer(dest.parent / f".{dest.name}-tokenizer", demo, special or [],
                                           tokenizer_class)
    return random_checkpoint(dest, tokenizer_from, **settings)


def _custom_tokenizer(dest: Path, demo: Path, special: list[str], tokenizer_class: str | None) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    if special:
        tok.add_special_tokens({"additional_special_tokens": special})
    tok.save_pretrained(dest)
    shutil.copy(demo / "tokenizer.model", dest / "tokenizer.model")
    if tokenizer_class:
        cfg = json.loads((dest / "tokenizer_config.json").read_text())
        cfg["tokenizer_class"] = tokenizer_class
        (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (dest / "config.json").write_text(json.dumps({"vocab_size": len(tok)}))
    return dest


# --- GGUF surgery ---------------------------------------------------------------------------------


def gguf_swap_tokens(src: Path, dest: Path, a: int, b: int) -> None:
    """Copy a GGUF with the vocabulary entries (text, score, type) of token ids ``a`` and ``b`` swapped:
    the crafted 'silently wrong vocabulary' the tokenizer parity check must catch."""
    swapped = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")

    def swap(name: str, value: Any) -> Any:
        if name in swapped:
            value = list(value)
            value[a], value[b] = value[b], value[a]
        return value

    gguf_rewrite(src, dest, swap)


def gguf_set_fields(src: Path, dest: Path, **fields: Any) -> None:
    """Copy a GGUF with the values of existing metadata keys replaced (``**{"llama.block_count": 3}``)."""
    gguf_rewrite(src, dest, lambda name, value: fields.get(name, value))


def gguf_rewrite(src: Path, dest: Path, edit: Any) -> None:
    """Copy a GGUF, every metadata value passed through ``edit(name, value)``, the tensors as they are. Uses
    gguf-py's reader and writer (PyPI gguf)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(dest), arch=arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        value = edit(name, field.contents())
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()


# --- a vocabulary above 16k -----------------------------------------------------------------------

#: The demo checkpoint widened to a 30,000-token vocabulary (not a multiple of 64, so vLLM pads its lm_head
#: and must cut the padding off): see :func:`wide_vocab_checkpoint`.
WIDE_VOCAB: dict[str, Any] = {"vocab_size": 30_000, "noise": 1.0, "seed": 0, "version": 1}


def wide_vocab_checkpoint(dest: Path, demo: Path, recipe: dict[str, Any] | None = None) -> Path:
    """The trained demo checkpoint with its vocabulary widened to ``recipe["vocab_size"]``, built in seconds.

    Token ``j`` ≥ 4096 is an alias of demo token ``j % 4096``: the same input embedding (so a window that
    uses aliases reads like the demo text) and that token's output row plus Gaussian noise of ``noise`` times
    the rows' standard deviation, so every prediction is spread over all aliases of the likely tokens: on the
    demo's held-out text, an entropy of about 7.2 nats, about half of the mass above id 16,384. Deterministic
    (CPU generator seeded by ``seed``); the demo tokenizer and texts are copied (its ids stay below 4096).
    """
    import torch
    from transformers import AutoModelForCausalLM

    recipe = recipe or WIDE_VOCAB
    vocab = int(recipe["vocab_size"])
    model: Any = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32)
    emb: Any = model.get_input_embeddings().weight.data
    head: Any = model.get_output_embeddings().weight.data
    base = int(emb.shape[0])
    alias = torch.arange(vocab) % base
    gen = torch.Generator().manual_seed(int(recipe["seed"]))
    noise = torch.randn(vocab - base, int(head.shape[1]), generator=gen) * head.std() * float(recipe["noise"])
    new_head = torch.cat([head, head[alias[base:]] + noise])
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.get_input_embeddings().weight.data.copy_(emb[alias])
    model.get_output_embeddings().weight.data.copy_(new_head)
    model.config.vocab_size = vocab
    model.save_pretrained(dest, safe_serialization=True)
    for name in (*TOKENIZER_FILES, "eval.txt", "calibration.txt"):
        if (demo / name).exists():
            shutil.copy(demo / name, dest / name)
    return dest


def alias_ids(ids: Any, vocab: int, base: int = 4096, seed: int = 0) -> Any:
    """Window ids [n, W] with every token after the first replaced by a random alias of itself (the same
    id modulo ``base``, below ``vocab``): the same text to a :func:`wide_vocab_checkpoint`, with targets
    spread over the whole vocabulary."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.asarray(ids, dtype=np.int64)
    out = ids.copy()
    room = (vocab - 1 - ids[:, 1:]) // base + 1  # aliases below vocab per token
    out[:, 1:] = ids[:, 1:] + base * np.floor(rng.random(ids[:, 1:].shape) * room).astype(np.int64)
    return out.astype(np.int32)
