from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from evaluators.metrics import compare, kld_per_position, perplexity, top1_agreement
from evaluators.protocol import Collector


def _softmax_logp(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def _runner_arrays(ref_logits: np.ndarray, q_logits: np.ndarray, targets: np.ndarray, k: int):
    ref = Collector(k, None)
    ref.add_logprobs(_softmax_logp(ref_logits), targets)
    ref_arr = {key: np.concatenate(v) for key, v in ref.parts.items() if v}
    q = Collector(k, ref_arr["topk_ids"].astype(np.int64))
    q.add_logprobs(_softmax_logp(q_logits), targets)
    return ref_arr, {key: np.concatenate(v) for key, v in q.parts.items() if v}


def test_perplexity_known_value() -> None:
    lp = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
    p = perplexity(lp)
    assert p.ppl == pytest.approx(math.exp(-lp.mean()))
    assert p.n_tokens == 4 and p.nll_se > 0


def test_kld_against_itself_is_exactly_zero() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(50, 300)) * 3
    targets = rng.integers(0, 300, 50)
    ref, q = _runner_arrays(logits, logits, targets, 16)
    m = compare(ref, q)
    assert m["kld_mean"] == 0.0 and m["kld_max"] == 0.0
    assert m["top1_agreement"] == 1.0 and m["delta_ppl_pct"] == 0.0 and m["delta_p_mean"] == 0.0


def test_kld_is_exact_with_full_vocabulary() -> None:
    rng = np.random.default_rng(1)
    v = 40
    pl, ql = rng.normal(size=(30, v)), rng.normal(size=(30, v))
    ref, q = _runner_arrays(pl, ql, rng.integers(0, v, 30), k=v)
    lp, lq = _softmax_logp(pl), _softmax_logp(ql)
    exact = (np.exp(lp) * (lp - lq)).sum(axis=1)
    got = kld_per_position(ref["topk_logprobs"], ref["tail_logprob"], q["at_ref_logprobs"], q["at_ref_tail"])
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(pl=arrays(np.float64, (8, 24), elements=st.floats(-6, 6)), ql=arrays(np.float64, (8, 24),
       elements=st.floats(-6, 6)), k=st.integers(1, 24))
def test_topk_kld_is_a_lower_bound(pl: np.ndarray, ql: np.ndarray, k: int) -> None:
    ref, q = _runner_arrays(pl, ql, np.zeros(8, dtype=np.int64), k)
    lp, lq = _softmax_logp(pl), _softmax_logp(ql)
    exact = (np.exp(lp) * (lp - lq)).sum(axis=1)
    approx = kld_per_position(ref["topk_logprobs"], ref["tail_logprob"], q["at_ref_logprobs"], q["at_ref_tail"])
    # The runner stores log-probs as float32 (relative precision ~6e-8 on values up to |12|): allow that much.
    assert np.all(approx <= exact + 1e-6 + 1e-5 * np.abs(exact)), (approx, exact)
    assert np.all(approx >= 0)


def test_top1_agreement() -> None:
    assert top1_agreement(np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4])) == 0.75
    with pytest.raises(ValueError):
        top1_agreement(np.array([1]), np.array([1, 2]))


def test_compare_rejects_different_window_sets() -> None:
    rng = np.random.default_rng(2)
    ref, q = _runner_arrays(rng.normal(size=(5, 10)), rng.normal(size=(5, 10)), np.zeros(5, dtype=np.int64), 3)
    q = {k: v[:4] for k, v in q.items()}
    with pytest.raises(ValueError, match="not the same window set"):
        compare(ref, q)


def test_variant_against_a_reference_skips_its_own_topk_unless_asked() -> None:
    """Scored against a reference, a runner needs only the log-probs at the reference's ids: its own top-K
    is left out (a selection over the vocabulary per position), and the metrics do not change."""
    rng = np.random.default_rng(2)
    pl, ql = rng.normal(size=(40, 200)) * 3, rng.normal(size=(40, 200)) * 3
    targets = rng.integers(0, 200, 40)
    ref, lean = _runner_arrays(pl, ql, targets, 8)
    assert "topk_ids" in ref and "topk_ids" not in lean and "tail_logprob" not in lean
    full = Collector(8, ref["topk_ids"].astype(np.int64), own_topk=True)
    full.add_window(ql, np.concatenate([[0], targets]), 1)
    full_arr = {key: np.concatenate(v) for key, v in full.parts.items() if v}
    assert full_arr["topk_ids"].shape == (40, 8)
    assert full_arr["topk_ids"][:, 0].tolist() == np.argmax(ql, axis=1).tolist()
    np.testing.assert_allclose(full_arr["at_ref_logprobs"], lean["at_ref_logprobs"], rtol=0, atol=1e-5)
    assert compare(ref, full_arr)["kld_mean"] == pytest.approx(compare(ref, lean)["kld_mean"], rel=1e-5)
