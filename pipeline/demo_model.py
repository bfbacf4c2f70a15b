"""The bundled demo checkpoint: a small Llama trained locally, with no download.

The training text is the Python standard library's own sources, present on
every machine. Files are split by a hash of their name into training,
calibration and held-out evaluation text, so calibration (AWQ, imatrix) never
sees the evaluation text. A SentencePiece BPE tokenizer (Llama style, byte
fallback) is trained on the training text, then a 4-layer Llama (hidden 256,
FFN 768: multiples of 256 so llama.cpp's K-quants apply) is trained for a
fixed number of steps with a fixed seed.

The result is cached under ``CACHE_DIR/demo/<recipe-hash>`` where the hash
covers the recipe and the exact training text, so tests and the demo reuse it.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.fs import atomic_path
from pipeline.specs import Frozen
from pipeline.texts import CALIB_TEXT, EVAL_TEXT, MAX_CALIB_BYTES, MAX_EVAL_BYTES, MAX_TRAIN_BYTES, builtin_corpus

RECIPE_FILE = "quantyard-demo.json"


class DemoRecipe(Frozen):
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 160
    lr: float = 3e-3
    seed: int = 0
    threads: int = 2
    max_train_bytes: int = MAX_TRAIN_BYTES
    max_eval_bytes: int = MAX_EVAL_BYTES
    max_calib_bytes: int = MAX_CALIB_BYTES
    tie_embeddings: bool = False
    dtype: str = "float32"


def corpus(recipe: DemoRecipe) -> dict[str, str]:
    """The train / calib / eval texts of ``recipe`` (the built-in corpus, see pipeline.texts)."""
    return builtin_corpus(recipe.max_train_bytes, recipe.max_calib_bytes, recipe.max_eval_bytes)


def recipe_key(recipe: DemoRecipe, texts: dict[str, str]) -> str:
    h = hashlib.sha256(recipe.model_dump_json().encode())
    for split in ("train", "calib", "eval"):
        h.update(hashlib.sha256(texts[split].encode()).digest())
    return h.hexdigest()[:16]


def _train_tokenizer(text: str, recipe: DemoRecipe, out_dir: Path) -> Path:
    import sentencepiece as spm

    lines = [ln for ln in text.splitlines() if ln.strip()]
    # Written through model_writer, not model_prefix: the proto records model_prefix, and a temporary
    # folder's name in it would change tokenizer.model, hence the checkpoint's content hash, on every build.
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=recipe.vocab_size,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        max_sentence_length=8192,
        minloglevel=2,
    )
    path = out_dir / "spm.model"
    path.write_bytes(model.getvalue())
    return path


def _hf_tokenizer(spm_model: Path, out_dir: Path):  # noqa: ANN202 - transformers type
    from transformers import LlamaTokenizer

    tok_dir = out_dir / "tok"
    tok_dir.mkdir()
    shutil.copy(spm_model, tok_dir / "tokenizer.model")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
    }))
    return LlamaTokenizer.from_pretrained(str(tok_dir))


def _batches(ids: list[int], recipe: DemoRecipe, steps: int):  # noqa: ANN202 - generator of tensors
    import torch

    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(recipe.seed)
    span = recipe.seq_len + 1
    for _ in range(steps):
        starts = torch.randint(0, len(data) - span, (recipe.batch_size,), generator=gen)
        yield torch.stack([data[s: s + span] for s in starts.tolist()])


def _build_model(recipe: DemoRecipe):  # noqa: ANN202 - transformers type
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads, num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=recipe.tie_embeddings, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def train(recipe: DemoRecipe, ids: list[int], progress: Callable[[int, int, float], None] | None = None):  # noqa: ANN201
    """Train the demo model on ``ids``; deterministic for a fixed recipe and thread count."""
    import torch

    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    model = _build_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, recipe.steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (recipe.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    for step, batch in enumerate(_batches(ids, recipe, recipe.steps)):
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if progress is not None:
            progress(step + 1, recipe.steps, float(out.loss.detach()))
    model.eval()
    return model


def build_demo_model(dest: Path, recipe: DemoRecipe | None = None,
                     progress: Callable[[int, int, float], None] | None = None) -> dict[str, object]:
    """Build the demo checkpoint into ``dest`` (created; must not exist or be empty).

    Returns the recipe record written to ``dest/quantyard-demo.json``.
    """
    recipe = recipe or DemoRecipe()
    texts = corpus(recipe)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spm_model = _train_tokenizer(texts["train"], recipe, Path(tmp))
        tokenizer = _hf_tokenizer(spm_model, Path(tmp))
        ids = tokenizer(texts["train"], add_special_tokens=False)["input_ids"]
        model = train(recipe, ids, progress)
        dest.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
        shutil.copy(spm_model, dest / "tokenizer.model")
    (dest / EVAL_TEXT).write_text(texts["eval"], encoding="utf-8")
    (dest / CALIB_TEXT).write_text(texts["calib"], encoding="utf-8")
    record = {
        "recipe": recipe.model_dump(),
        "key": recipe_key(recipe, texts),
        "train_tokens": len(ids),
        "eval_text": EVAL_TEXT,
        "calibration_text": CALIB_TEXT,
    }
    # Everything written is a function of the recipe and the corpus (training is deterministic on one CPU
    # type), so a rebuild has the same content hash, i.e. the same source identity and registry keys; the
    # wall time is returned, not written.
    (dest / RECIPE_FILE).write_text(json.dumps(record, indent=2))
    return {**record, "train_seconds": round(time.perf_counter() - started, 1)}


def cached_demo_model(cache_dir: Path, recipe: DemoRecipe | None = None,
                      progress: Callable[[int, int, float], None] | None = None) -> Path:
    """Return the cached demo checkpoint for ``recipe``, building it once (atomically) if missing."""
    recipe = recipe or DemoRecipe()
    key = recipe_key(recipe, corpus(recipe))
    final = cache_dir / "demo" / key
    if (final / RECIPE_FILE).exists():
        return final
    try:
        with atomic_path(final) as staging:
            build_demo_model(staging, recipe, progress)
    except OSError:
        if not (final / RECIPE_FILE).exists():  # lost a race to another builder: theirs is as good
            raise
    return final
