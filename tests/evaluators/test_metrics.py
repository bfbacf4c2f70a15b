from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from evaluators.metrics import compare, kld_per_position, perplexity, top1_agreement, window_bootstrap
from evaluators.protocol import FULL_RANGE, FULL_STEPS, Collector, Reference, encode_rows, kld_rows


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
    assert m["kld_topk_lower_bound_mean"] == 0.0 and m["kld_topk_lower_bound_max"] == 0.0
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
    key = "kld_topk_lower_bound_mean"
    assert compare(ref, full_arr)[key] == pytest.approx(compare(ref, lean)[key], rel=1e-5)


# --- the exact KL-divergence over the whole vocabulary ------------------------------------------------


def _exact_kld(pl: np.ndarray, ql: np.ndarray) -> np.ndarray:
    """KL(P ‖ Q) per row, all in float64 from the logits (the definition)."""
    lp, lq = _softmax_logp(pl.astype(np.float64)), _softmax_logp(ql.astype(np.float64))
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def _llm_like_logits(rng: np.random.Generator, n: int, v: int, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Reference logits with an LLM's shape (a few likely tokens, a long tail over ~30 nats) and a variant's
    perturbed by ``noise`` (a quantization's error in logit space)."""
    base = rng.gumbel(size=(n, v)) * 2.5 - 0.002 * np.arange(v)[None, :] * rng.uniform(0.5, 1.5, (n, 1))
    q = base + rng.normal(scale=noise, size=(n, v))
    return base.astype(np.float32), q.astype(np.float32)


def _reference_file(tmp_path: Path, logits: np.ndarray, targets: np.ndarray, k: int = 8) -> Reference:
    col = Collector(k, None, store_full=tmp_path, rows=len(logits))
    col.add_rows(logits, targets)
    col.save(tmp_path)
    return Reference(tmp_path / "logprobs.npz")


@pytest.mark.parametrize("noise", [0.003, 0.03, 0.3])
def test_exact_kld_matches_the_float64_definition(tmp_path: Path, noise: float) -> None:
    """The runner's mean KLD against the stored 16-bit reference is the float64 KL-divergence of the logits
    to 1e-3 relative, from an F16-like error (KLD ~2e-6) to a Q2-like one (~0.02); per position, the
    reference's rounding (half a step δ in each log-prob) moves it by at most about δ·sqrt(2·KL)."""
    rng = np.random.default_rng(3)
    pl, ql = _llm_like_logits(rng, 300, 5000, noise)
    targets = rng.integers(0, 5000, 300)
    ref = _reference_file(tmp_path, pl, targets)
    col = Collector(8, ref)
    col.add_rows(ql, targets)
    got = np.concatenate(col.parts["kld"])
    exact = _exact_kld(pl, ql)
    assert got.mean() == pytest.approx(exact.mean(), rel=1e-3)
    step = float(np.max(ref.step))
    assert np.all(np.abs(got - exact) <= step * np.sqrt(2 * exact) + 1e-7)


def test_the_collectors_exact_kld_is_kld_rows_to_the_bit(tmp_path: Path) -> None:
    """The Collector shares x − max x and Σ e^(x − max x) between the log-probs and the KLD; the KLD it gets is
    kld_rows' exactly, masked tokens (-inf, an infinite KLD where only the variant masks) included."""
    rng = np.random.default_rng(9)
    pl, ql = _llm_like_logits(rng, 260, 3000, 0.1)
    pl[3, 5] = -np.inf  # the reference masks a token: no term
    ql[4, 7] = -np.inf  # the variant alone masks one: infinite
    pl[10, 9] = ql[10, 9] = -np.inf  # both mask the same token: no term
    pl[11, 1] = ql[11, 2] = -np.inf  # each masks another: infinite
    targets = rng.integers(0, 3000, 260)
    ref = _reference_file(tmp_path, pl, targets)
    col = Collector(8, ref)
    col.add_rows(ql, targets)
    got = np.concatenate(col.parts["kld"])
    assert np.array_equal(got, kld_rows(ql, *ref.rows(0, 260)))
    assert np.isinf(got[[4, 11]]).all() and np.isfinite(np.delete(got, [4, 11])).all()


def test_exact_kld_of_a_reference_against_itself_is_its_rounding_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    pl, _ = _llm_like_logits(rng, 50, 3000, 0.0)
    ref = _reference_file(tmp_path, pl, np.zeros(50, dtype=np.int64))
    got = kld_rows(pl, *ref.rows(0, 50))
    step = float(np.max(ref.step))
    assert 0 <= got.max() < step**2  # KL(P̃‖P) ≈ step²/24
    assert step <= FULL_RANGE / FULL_STEPS


def test_the_reference_is_stored_uncompressed_and_read_in_place(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    pl, _ = _llm_like_logits(rng, 40, 700, 0.0)
    ref = _reference_file(tmp_path, pl, rng.integers(0, 700, 40))
    assert isinstance(ref.codes, np.memmap) and ref.codes.shape == (40, 700) and ref.codes.dtype == np.uint16
    codes, _, _ = encode_rows(pl)
    assert np.array_equal(np.asarray(ref.codes), codes)
    # 2 bytes per logit plus the small arrays: never compressed, never more than that
    assert (tmp_path / "logprobs.npz").stat().st_size < 40 * 700 * 2 + 40 * (8 + 8 * 4 + 8 + 8 + 4) + 4096


def test_the_distribution_streams_into_the_npz_once(tmp_path: Path) -> None:
    """The reference runner knows its row count (from its window file), so the codes go straight into the npz,
    block by block: the file holds encode_rows' codes of every row and the same other arrays as a collector
    that stores nothing, with no partial file left; a run that adds fewer or more rows than announced fails
    instead of writing a distribution its header misstates, and a stored distribution without a row count is
    refused."""
    rng = np.random.default_rng(8)
    pl, _ = _llm_like_logits(rng, 300, 900, 0.0)
    targets = rng.integers(0, 900, 300)
    outs = {}
    for name, store in (("plain", False), ("streamed", True)):
        d = tmp_path / name
        d.mkdir()
        col = Collector(8, None, store_full=d if store else None, rows=300 if store else None)
        for a in range(0, 300, 70):  # several add_rows calls, each of several blocks
            col.add_rows(pl[a:a + 70], targets[a:a + 70])
        assert col.save(d) == 300
        assert sorted(p.name for p in d.iterdir()) == ["logprobs.npz"]
        with np.load(d / "logprobs.npz") as z:
            outs[name] = {k: z[k] for k in z.files}
    ref = Reference(tmp_path / "streamed" / "logprobs.npz")
    assert isinstance(ref.codes, np.memmap) and ref.codes.shape == (300, 900)
    streamed = outs["streamed"]
    for key, expected in zip(("full_codes", "full_lo", "full_step"), encode_rows(pl.copy()), strict=True):
        assert np.array_equal(streamed.pop(key), expected), key
    assert streamed.keys() == outs["plain"].keys()
    for key, value in outs["plain"].items():
        assert np.array_equal(value, streamed[key]), key
    for added, match in ((299, "299 positions added, the window set scores 300"), (301, "more than the 300")):
        d = tmp_path / f"wrong{added}"
        d.mkdir()
        col = Collector(8, None, store_full=d, rows=300)
        with pytest.raises(SystemExit, match=match):
            col.add_rows(pl[:min(added, 300)], targets[:min(added, 300)])
            if added > 300:
                col.add_rows(pl[:1], targets[:1])
            col.save(d)
        assert not (d / "logprobs.npz").exists()
    with pytest.raises(SystemExit, match="store_full needs the number of positions"):
        Collector(8, None, store_full=tmp_path)


def test_minus_infinity_logits_are_probability_zero(tmp_path: Path) -> None:
    """Masked vocabulary entries (-inf in both) add nothing; a token the reference gives mass and the variant
    masks makes the divergence infinite, as it is."""
    pl = np.array([[2.0, 1.0, 0.0, -np.inf]], np.float32)
    ql = np.array([[1.9, 1.1, 0.0, -np.inf]], np.float32)
    ref = _reference_file(tmp_path, pl, np.array([0]), k=2)
    assert ref.codes[0, 3] == 0
    got = kld_rows(ql, *ref.rows(0, 1))
    assert got[0] == pytest.approx(_exact_kld(pl[:, :3], ql[:, :3])[0], rel=1e-3)
    assert np.isinf(kld_rows(np.array([[2.0, -np.inf, 0.0, -np.inf]], np.float32), *ref.rows(0, 1))[0])


def test_exact_kld_needs_a_full_reference(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    pl, _ = _llm_like_logits(rng, 10, 100, 0.0)
    col = Collector(8, None)  # no store_full: top-K only
    col.add_rows(pl, np.zeros(10, dtype=np.int64))
    col.save(tmp_path)
    with pytest.raises(SystemExit, match="whole distribution"):
        Collector(8, Reference(tmp_path / "logprobs.npz"), kld="full")
    assert Collector(8, Reference(tmp_path / "logprobs.npz")).kld == "topk"


def test_compare_reports_exact_kld_and_a_topk_bound_under_different_names(tmp_path: Path) -> None:
    """Exact: kld_mean, method full-vocabulary. Top-K: only kld_topk_lower_bound_*, below the exact value,
    and no kld_mean, so nothing can show or gate it as the KLD."""
    rng = np.random.default_rng(7)
    pl, ql = _llm_like_logits(rng, 200, 2000, 0.1)
    targets = rng.integers(0, 2000, 200)
    ref = _reference_file(tmp_path, pl, targets, k=32)
    ref_arrays = {k: v for k, v in np.load(tmp_path / "logprobs.npz").items() if k != "full_codes"}
    outs = {}
    for mode in ("full", "topk"):
        col = Collector(32, ref, kld=mode)
        col.add_rows(ql, targets)
        outs[mode] = compare(ref_arrays, {k: np.concatenate(v) for k, v in col.parts.items() if v}, np.full(4, 50))
    exact, bound = outs["full"], outs["topk"]
    assert exact["kld_method"] == "full-vocabulary" and "kld_topk_lower_bound_mean" not in exact
    assert bound["kld_method"] == "top32-lower-bound" and "kld_mean" not in bound
    assert bound["kld_topk_lower_bound_mean"] < exact["kld_mean"]
    assert exact["kld_mean"] == pytest.approx(_exact_kld(pl, ql).mean(), rel=1e-4)
    assert exact["kld_ci95_low"] < exact["kld_mean"] < exact["kld_ci95_high"]


def test_window_bootstrap_widens_the_interval_of_correlated_tokens() -> None:
    """Tokens of one window share a level (correlated): the window bootstrap's standard error is the spread
    of the window means, several times the independent-token formula's."""
    rng = np.random.default_rng(8)
    levels = rng.normal(3.0, 0.5, 40)
    nll = np.repeat(levels, 100) + rng.normal(0, 0.2, 4000)
    boot = window_bootstrap({"nll": nll}, np.full(40, 100))["nll"]
    iid = nll.std(ddof=1) / math.sqrt(nll.size)
    block = levels.std(ddof=1) / math.sqrt(40)
    assert boot.std() == pytest.approx(block, rel=0.15)
    assert boot.std() > 4 * iid
    assert window_bootstrap({"nll": nll}, np.array([4000]))["nll"].size == 0  # one window: no interval
