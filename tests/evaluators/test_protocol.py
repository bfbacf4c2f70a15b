"""The runner protocol's row helpers, against plain numpy on the same rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from evaluators.protocol import TOPK_MAX_CANDIDATES, Collector, top_k_rows


def _by_sorting(x: np.ndarray, k: int) -> np.ndarray:
    """The top ``k`` ids of each row by sorting the whole row: largest first, equal values in id order."""
    return np.argsort(-x.astype(np.float64), axis=1, kind="stable")[:, :k]


def test_top_k_of_llm_like_logits_is_the_whole_sort() -> None:
    """Heavy-tailed rows of a 49k vocabulary, the shape the reference runner scores: the bounded candidate
    path, not the fallback, gives what sorting every row gives."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((96, 49152)) * 2.5).astype(np.float32)
    x[np.arange(96), rng.integers(0, 49152, 96)] += 12.0  # a confident token in each row
    assert np.array_equal(top_k_rows(x, 32), _by_sorting(x, 32))


def test_equal_values_come_in_id_order() -> None:
    """Integer logits in a small range: most of each row's top values tie, across blocks and inside them."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 6, size=(40, 5000)).astype(np.float32)
    got = top_k_rows(x, 16)
    assert np.array_equal(got, _by_sorting(x, 16))
    assert (np.diff(got, axis=1)[np.diff(np.take_along_axis(x, got, axis=1), axis=1) == 0] > 0).all()


def test_masked_rows_flat_rows_and_rows_with_nan_are_sorted_whole() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 8192)).astype(np.float32)
    x[0] = -np.inf
    x[0, [7, 4000, 8191]] = [1.0, 3.0, 2.0]  # three finite values: the bound is -inf, every id a candidate
    x[1] = -np.inf  # all masked
    x[2, :TOPK_MAX_CANDIDATES + 10] = 50.0  # more equal candidates than the cap
    x[3, 100] = np.nan
    got = top_k_rows(x, 8)
    assert np.array_equal(got, _by_sorting(x, 8))
    assert list(got[0]) == [4000, 8191, 7, 0, 1, 2, 3, 4]  # then the masked ids, in id order
    assert 100 not in got[3]  # NaN sorts last


@pytest.mark.parametrize(("v", "k"), [(40, 32), (50, 100), (700, 32), (49152, 1), (3, 0)])
def test_small_vocabularies_and_k_beyond_the_vocabulary(v: int, k: int) -> None:
    x = np.random.default_rng(3).standard_normal((7, v)).astype(np.float32)
    got = top_k_rows(x, k)
    assert got.shape == (7, min(k, v))
    assert np.array_equal(got, _by_sorting(x, min(k, v)))


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(64, 3000)),
              elements=st.floats(-30, 30, width=32) | st.sampled_from([np.float32(-np.inf), np.float32(0.0)])),
       st.integers(1, 40))
def test_top_k_is_the_whole_sort_on_any_rows(x: np.ndarray, k: int) -> None:
    assert np.array_equal(top_k_rows(x, k), _by_sorting(x, min(k, x.shape[1])))


def test_the_reference_collector_keeps_the_top_k_of_its_rows(tmp_path: Path) -> None:
    """The reference runner's own top-K (``topk_ids``, ``topk_logprobs``, ``tail_logprob``) from the
    candidate path: the ids are the whole sort's, their log-probs those of a float64 log-softmax."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((300, 20000)) * 3).astype(np.float32)
    targets = rng.integers(0, 20000, 300)
    col = Collector(16, None, store_full=tmp_path, rows=300)
    col.add_rows(x, targets)
    col.save(tmp_path)
    with np.load(tmp_path / "logprobs.npz") as z:
        ids, lp, tail = z["topk_ids"], z["topk_logprobs"], z["tail_logprob"]
    assert np.array_equal(ids, _by_sorting(x, 16))
    x64 = x.astype(np.float64)
    logp = x64 - (x64.max(axis=1, keepdims=True)
                  + np.log(np.exp(x64 - x64.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)))
    np.testing.assert_allclose(lp, np.take_along_axis(logp, ids, axis=1), rtol=1e-6)
    rest = 1.0 - np.exp(np.take_along_axis(logp, ids, axis=1)).sum(axis=1)
    np.testing.assert_allclose(np.exp(tail), rest, rtol=1e-6)
