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
                      **extra: Any) -> Path:
    """A randomly initialised causal LM of ``model_type`` with the demo tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    tok_cfg = json.loads((tokenizer_from / "config.json").read_text())
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size or tok_cfg["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
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
