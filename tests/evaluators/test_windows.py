from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from evaluators.windows import WindowSet, build_window_set, cut_windows
from pipeline.errors import InvalidSpecError


@pytest.mark.parametrize(("window", "stride", "bos"), [(8, 8, None), (8, 8, 1), (8, 3, 1), (8, 5, None),
                                                        (6, 2, 1), (8, 12, 1)])
def test_every_text_token_scored_at_most_once(window: int, stride: int, bos: int | None) -> None:
    tokens = list(range(100, 180))
    ws = cut_windows(tokens, window=window, stride=stride, bos_id=bos)
    scored = []
    for k in range(ws.n_windows):
        text_start = k * stride
        for i in range(int(ws.score_start[k]), window):
            pos = text_start + i - (1 if bos is not None else 0)
            assert ws.ids[k, i] == tokens[pos]
            scored.append(pos)
    assert len(scored) == len(set(scored)) == ws.n_scored
    if stride <= window - 1:
        # contiguous coverage: from the first scored token to the end of the last window
        assert sorted(scored) == list(range(min(scored), max(scored) + 1))
    assert ws.scored_targets().tolist() == [tokens[p] for p in scored]


@pytest.mark.parametrize(("window", "stride", "score_from"), [(8, 8, 5), (8, 8, 7), (8, 4, 5), (8, 3, 2), (8, 12, 3)])
def test_score_from_scores_only_late_positions(window: int, stride: int, score_from: int) -> None:
    tokens = list(range(100, 180))
    full = cut_windows(tokens, window=window, stride=stride, bos_id=1)
    late = cut_windows(tokens, window=window, stride=stride, bos_id=1, score_from=score_from)
    assert np.array_equal(late.ids, full.ids)
    assert late.score_start.tolist() == [max(int(s), score_from) for s in full.score_start]
    assert late.n_scored == sum(window - int(s) for s in late.score_start) < full.n_scored
    assert late.id != full.id and late.meta()["score_from"] == score_from
    # every target scored late is one the default set scores too, once
    scored = [k * stride + i for k in range(late.n_windows) for i in range(int(late.score_start[k]), window)]
    assert len(scored) == len(set(scored))


def test_score_from_second_half_matches_llama_perplexity_chunks() -> None:
    """window 8, stride 8, score_from 5: targets 5..7 of each chunk, llama-perplexity's n_ctx/2+1 .. n_ctx-1."""
    ws = cut_windows(list(range(100, 140)), window=8, stride=8, bos_id=1, score_from=8 // 2 + 1)
    assert ws.score_start.tolist() == [5] * ws.n_windows and ws.n_scored == 3 * ws.n_windows


@pytest.mark.parametrize("score_from", [0, 8, 9])
def test_score_from_out_of_range(score_from: int) -> None:
    with pytest.raises(InvalidSpecError, match=r"score_from must be in 1\.\.7"):
        cut_windows(list(range(50)), window=8, stride=8, bos_id=1, score_from=score_from)


def test_window_set_id_and_roundtrip(tmp_path: Path) -> None:
    ws = cut_windows(list(range(50)), window=10, stride=10, bos_id=1, text_sha256="abc")
    ws.save(tmp_path / "w.npz")
    back = WindowSet.load(tmp_path / "w.npz")
    assert back.id == ws.id and np.array_equal(back.ids, ws.ids)
    assert cut_windows(list(range(50)), window=10, stride=5, bos_id=1).id != ws.id


def test_too_little_text() -> None:
    with pytest.raises(InvalidSpecError, match="fewer than one window"):
        cut_windows([1, 2, 3], window=8, stride=8, bos_id=None)


def test_demo_window_set_uses_hf_tokenizer(demo_model: Path) -> None:
    from transformers import AutoTokenizer

    text = (demo_model / "eval.txt").read_text()[:20000]
    ws = build_window_set(demo_model, text, window=128, stride=128)
    tok = AutoTokenizer.from_pretrained(str(demo_model))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ws.add_bos and ws.ids[0, 0] == tok.bos_token_id
    assert ws.ids[0, 1:].tolist() == ids[:127]
    assert ws.ids[1, 1:].tolist() == ids[128:255]
