"""Quality metrics of a variant against the unquantized reference, on the shared window set.

These are the figures ``llama-perplexity --kl-divergence`` reports (PPL, ln(PPL_q/PPL_ref),
KLD and its percentiles, "same top" %, Δp), computed on our shared windows so every engine
is comparable.

**KL-divergence, exact.** ``kld_mean`` is the mean over scored positions of KL(P_ref ‖ Q) summed over the
whole vocabulary, what ``llama-perplexity --kl-divergence`` reports. The runner computes it per position
(``evaluators.protocol.kld_rows``) against the reference's stored distribution, rounded to a 16-bit grid
of at most 6.1e-4 nats (llama.cpp rounds its base the same way, over 16 nats instead of 40, and leaves out
the tokens whose base log-prob is below -16; we keep them). ``kld_method`` says ``full-vocabulary``.

**Top-K lower bound (a cheaper mode, never shown as "KLD").** With ``kld="topk"`` the runner reports only
its log-probs at the reference's top-K ids; KL over the K+1 bins ``{v₁..v_K, V∖T}``

    KL_K(P‖Q) = Σ_{v∈T} P(v)·log(P(v)/Q(v)) + P(V∖T)·log(P(V∖T)/Q(V∖T))

is a lower bound (merging outcomes never increases KL-divergence), short of the exact value by
``P(V∖T)·KL(P|_tail ‖ Q|_tail)``: 21–24 % on SmolLM2-135M at K = 32. It is stored as
``kld_topk_lower_bound_mean`` with ``kld_method`` = ``top{K}-lower-bound``, and no ``kld_mean``, so a gate
written for the exact KLD never passes on it.

**llama-perplexity's statistics, field by field** (:func:`llama_perplexity_stats`): PPL(Q) and PPL(base) with
their uncertainties, the correlation of their logs, ln(PPL(Q)/PPL(base)), PPL(Q)/PPL(base) and PPL(Q)−PPL(base)
with theirs; mean KLD ± its uncertainty, maximum, 99.9/99/95/90 %, median, 10/5/1/0.1 % and minimum; the same for
Δp (plus 75 and 25 %), RMS Δp ± uncertainty, and "same top p" ± uncertainty. Each is computed as
``tools/perplexity/perplexity.cpp`` of the pinned llama.cpp computes it: its uncertainties are its independent-token
formulas (``mean_and_uncertainty``, ``covariance``: the ``*_unc`` fields, kept beside, never in place of, the window
bootstrap's intervals below), its percentiles interpolate linearly between sorted values at ``fraction · (n − 1)``
(numpy's default), its median is the middle value or the mean of the two middle ones. Where the definitions differ,
it is in the inputs, not the formulas: llama-perplexity's base is its 16-bit stored log-probs (PPL(base), Δp and the
base's top token come from the rounded values; here from the reference's float32 log-probs and full-precision top-1),
and its KLD leaves out the tokens whose base log-prob is below -16 (kept here).

**Beyond llama-perplexity** (:func:`by_confidence`): the mean KLD and "same top p" by the reference's confidence, the
probability of its top token in five bands (as exllamav3's ``qbench``), and the share of positions in each band: a
quantization that only loses where the reference was unsure differs from one that loses where it was sure.

**Uncertainty.** Tokens of one window are correlated, so standard errors and 95 % intervals of PPL,
ΔPPL, ln(PPL ratio) and KLD come from a bootstrap over whole windows (:func:`window_bootstrap`:
``BOOTSTRAP_RESAMPLES`` resamples of the windows with replacement, fixed seed), not from the
independent-token formula. ``ci_method`` says so.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
#: Resamples of the tail percentiles' intervals (each one sorts its resample: fewer than the means' 2000)
PERCENTILE_RESAMPLES = 400
#: The KLD percentiles a policy may gate (pipeline/policy.py), with a window-bootstrap interval each.
GATED_PERCENTILES = (("p99", 99.0), ("p999", 99.9))
BOOTSTRAP_SEED = 0
CI_METHOD = f"bootstrap over windows ({BOOTSTRAP_RESAMPLES} resamples, 95 % percentile interval)"


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll_mean: float
    nll_se: float
    n_tokens: int

    def to_dict(self) -> dict[str, float | int]:
        return {"ppl": self.ppl, "nll_mean": self.nll_mean, "nll_se": self.nll_se, "n_tokens": self.n_tokens,
                "ppl_ci95_low": math.exp(self.nll_mean - 1.96 * self.nll_se),
                "ppl_ci95_high": math.exp(self.nll_mean + 1.96 * self.nll_se)}


def perplexity(target_logprob: np.ndarray) -> Perplexity:
    """Perplexity ``exp(mean NLL)`` with the independent-token standard error of the mean NLL (nats/token).
    :func:`compare` replaces the error by the window bootstrap's."""
    nll = -np.asarray(target_logprob, dtype=np.float64)
    n = int(nll.size)
    if n == 0:
        raise ValueError("perplexity of zero tokens is undefined")
    mean = float(nll.mean())
    se = float(nll.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return Perplexity(ppl=math.exp(mean), nll_mean=mean, nll_se=se, n_tokens=n)


def window_bootstrap(values: dict[str, np.ndarray], sizes: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> dict[str, np.ndarray]:
    """Bootstrap distributions of per-token means, resampling whole windows with replacement.

    ``values``: name → per-position array (window-major, the scoring order); ``sizes``: the number of
    scored positions of each window (they sum to the arrays' length). Returns name → ``resamples`` means,
    each the token-weighted mean over one resample of the windows. Every name uses the same resamples, so
    paired differences (ΔPPL) keep their pairing. One window (or none): empty arrays.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    k = len(sizes)
    if k < 2:
        return {name: np.empty(0) for name in values}
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    idx = np.random.default_rng(seed).integers(0, k, size=(resamples, k))
    counts = sizes[idx].sum(axis=1).astype(np.float64)
    out = {}
    for name, v in values.items():
        v = np.asarray(v, dtype=np.float64)
        if len(v) != bounds[-1]:
            raise ValueError(f"{name}: {len(v)} positions, the windows hold {bounds[-1]}")
        sums = np.add.reduceat(v, bounds[:-1]) if len(v) else np.zeros(k)
        out[name] = sums[idx].sum(axis=1) / counts
    return out


def _interval(samples: np.ndarray, f: Any = None) -> tuple[float | None, float | None, float | None]:
    """(standard error, 2.5 %, 97.5 %) of bootstrap means, optionally through ``f`` (None where empty)."""
    if samples.size == 0:
        return None, None, None
    x = f(samples) if f is not None else samples
    lo, hi = np.percentile(x, [2.5, 97.5])
    return float(np.std(samples, ddof=1)), float(lo), float(hi)


def kld_per_position(ref_logprobs: np.ndarray, ref_tail: np.ndarray, q_logprobs: np.ndarray,
                     q_tail: np.ndarray) -> np.ndarray:
    """The top-K lower bound KL_K(P_ref ‖ Q) per position over the K+1 bins of the module docstring (nats).

    Args:
        ref_logprobs: [N, K] reference log-probs of its top-K tokens.
        ref_tail: [N] log of the reference's mass outside its top-K (``-inf`` when zero).
        q_logprobs: [N, K] the variant's log-probs of the *same* token ids.
        q_tail: [N] log of the variant's mass outside those ids.
    """
    lp = np.asarray(ref_logprobs, dtype=np.float64)
    lq = np.asarray(q_logprobs, dtype=np.float64)
    p = np.exp(lp)
    with np.errstate(invalid="ignore", divide="ignore"):
        head = np.where(p > 0, p * (lp - lq), 0.0).sum(axis=1)
        rt = np.asarray(ref_tail, dtype=np.float64)
        qt = np.asarray(q_tail, dtype=np.float64)
        pt = np.exp(rt)
        tail = np.where(pt > 0, pt * (rt - qt), 0.0)
    # Each term is >= 0 in exact arithmetic only in sum; clip float noise at 0.
    return np.maximum(head + tail, 0.0)


def percentiles(x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, dtype=np.float64)
    return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99)),
            "p999": float(np.percentile(x, 99.9)), "max": float(x.max())}


def kld_summary(kld: np.ndarray, prefix: str = "kld") -> dict[str, float]:
    kld = np.asarray(kld, dtype=np.float64)
    n = kld.size
    out = {f"{prefix}_mean": float(kld.mean()),
           f"{prefix}_se": float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")}
    out.update({f"{prefix}_{k}": v for k, v in percentiles(kld).items()})
    return out


def top1_agreement(ref_top1: np.ndarray, q_top1: np.ndarray) -> float:
    """Fraction (0..1) of positions where the variant's most likely token equals the reference's."""
    a, b = np.asarray(ref_top1), np.asarray(q_top1)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"top-1 arrays must have the same non-empty shape, got {a.shape} and {b.shape}")
    return float((a == b).mean())


def delta_p(ref_target_logprob: np.ndarray, q_target_logprob: np.ndarray) -> dict[str, float]:
    """Δp: the change in probability of the correct token, ``Q(target) − P(target)`` (mean and RMS)."""
    d = np.exp(np.asarray(q_target_logprob, np.float64)) - np.exp(np.asarray(ref_target_logprob, np.float64))
    return {"delta_p_mean": float(d.mean()), "delta_p_rms": float(np.sqrt((d * d).mean()))}


def ln_ppl_ratio(ref_target_logprob: np.ndarray, q_target_logprob: np.ndarray) -> dict[str, float]:
    """ln(PPL_q / PPL_ref) = mean NLL_q − mean NLL_ref, with the standard error of the paired difference."""
    d = -np.asarray(q_target_logprob, np.float64) + np.asarray(ref_target_logprob, np.float64)
    n = d.size
    return {"ln_ppl_ratio": float(d.mean()),
            "ln_ppl_ratio_se": float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")}


def topk_lower_bound(ref: dict[str, np.ndarray], q: dict[str, np.ndarray]) -> np.ndarray:
    """Per-position top-K lower bound from a runner's ``at_ref_*`` output (``kld="topk"``)."""
    return kld_per_position(ref["topk_logprobs"], ref["tail_logprob"], q["at_ref_logprobs"], q["at_ref_tail"])


#: llama-perplexity's KLD percentiles (its printed order: maximum first), as fractions and as field suffixes.
KLD_PERCENTILES = ((0.999, "p999"), (0.99, "p99"), (0.95, "p95"), (0.90, "p90"), (0.10, "p10"), (0.05, "p5"),
                   (0.01, "p1"), (0.001, "p01"))
#: llama-perplexity's Δp percentiles (KLD's, plus 75 % and 25 %).
DELTA_P_PERCENTILES = ((0.999, "p999"), (0.99, "p99"), (0.95, "p95"), (0.90, "p90"), (0.75, "p75"), (0.25, "p25"),
                       (0.10, "p10"), (0.05, "p5"), (0.01, "p1"), (0.001, "p01"))
#: The reference's confidence bands of :func:`by_confidence`: the probability of its top token.
CONFIDENCE_BANDS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def _mean_and_unc(x: np.ndarray) -> tuple[float, float]:
    """llama-perplexity's ``mean_and_uncertainty``: the mean and sqrt(var / (n − 1)), 0 for ten values or fewer."""
    n = x.size
    mean = float(x.sum() / n)
    var = float((x * x).sum() / n - mean * mean)
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def _cov(a: np.ndarray, b: np.ndarray) -> float:
    """llama-perplexity's ``covariance`` of two per-token series (0 below ten values)."""
    n = a.size
    if n < 10:
        return 0.0
    return float(((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1))


def _spread(x: np.ndarray, prefix: str, fractions: tuple[tuple[float, str], ...]) -> dict[str, float]:
    """Maximum, percentiles, median and minimum of ``x`` as llama-perplexity prints them."""
    s = np.sort(np.asarray(x, dtype=np.float64))
    out = {f"{prefix}_max": float(s[-1]), f"{prefix}_median": float(np.median(s)), f"{prefix}_min": float(s[0])}
    out.update({f"{prefix}_{name}": float(np.percentile(s, 100 * f)) for f, name in fractions})
    return out


def llama_perplexity_stats(ref: dict[str, np.ndarray], q: dict[str, np.ndarray], kld: np.ndarray) -> dict[str, float]:
    """Every statistic ``llama-perplexity --kl-divergence`` prints, with its definitions (module docstring), from
    the per-position target log-probs, top-1 ids and exact KLDs. Keys: ``ppl``/``ref_ppl`` with ``*_unc``,
    ``ln_ppl_cor``, ``ln_ppl_ratio_unc``, ``ppl_ratio`` (±), ``ppl_diff`` (±), ``kld_mean_unc`` and KLD's spread
    (``kld_p999`` … ``kld_min``), ``delta_p_mean_unc``, Δp's spread (``delta_p_max`` … ``delta_p_min``),
    ``delta_p_rms_unc``, ``top1_agreement_unc``."""
    nll = -np.asarray(q["target_logprob"], np.float64)
    nll_base = -np.asarray(ref["target_logprob"], np.float64)
    log_ppl, log_ppl_unc = _mean_and_unc(nll)
    log_base, log_base_unc = _mean_and_unc(nll_base)
    cov = _cov(nll, nll_base)
    ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
    ratio_ln = log_ppl - log_base
    ratio_ln_unc = math.sqrt(max(0.0, log_ppl_unc ** 2 + log_base_unc ** 2 - 2.0 * cov))
    ppl_unc, base_unc = ppl * log_ppl_unc, ppl_base * log_base_unc
    out = {"ppl_unc": ppl_unc, "ref_ppl_unc": base_unc,
           "ln_ppl_cor": cov / (log_ppl_unc * log_base_unc) if log_ppl_unc and log_base_unc else float("nan"),
           "ln_ppl_ratio_unc": ratio_ln_unc, "ppl_ratio": math.exp(ratio_ln),
           "ppl_ratio_unc": math.exp(ratio_ln) * ratio_ln_unc, "ppl_diff": ppl - ppl_base,
           "ppl_diff_unc": math.sqrt(max(0.0, ppl_unc ** 2 + base_unc ** 2 - 2.0 * ppl * ppl_base * cov))}
    k = np.asarray(kld, np.float64)
    out["kld_mean_unc"] = _mean_and_unc(k)[1]
    out.update(_spread(k, "kld", KLD_PERCENTILES))
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    out["delta_p_mean_unc"] = _mean_and_unc(p_diff)[1]
    out.update(_spread(p_diff, "delta_p", DELTA_P_PERCENTILES))
    mse, mse_unc = _mean_and_unc(p_diff * p_diff)
    out["delta_p_rms_unc"] = 0.5 / math.sqrt(mse) * mse_unc if mse > 0 else 0.0
    n = k.size
    same = float((np.asarray(ref["top1"]) == np.asarray(q["top1"])).mean())
    out["top1_agreement_unc"] = math.sqrt(same * (1.0 - same) / (n - 1)) if n > 1 else float("nan")
    return out


def by_confidence(ref: dict[str, np.ndarray], q: dict[str, np.ndarray], kld: np.ndarray) -> list[dict[str, Any]]:
    """Mean KLD and "same top p" by the reference's confidence (the probability of its top token) in the bands of
    :data:`CONFIDENCE_BANDS`, each with its share of the positions; an empty band has ``n`` 0 and no means."""
    conf = np.exp(np.asarray(ref["topk_logprobs"], np.float64)[:, 0])
    same = np.asarray(ref["top1"]) == np.asarray(q["top1"])
    k = np.asarray(kld, np.float64)
    out = []
    edges = CONFIDENCE_BANDS
    for i, (lo, hi) in enumerate(itertools.pairwise(edges)):
        inside = (conf >= lo) & ((conf < hi) if i < len(edges) - 2 else (conf <= hi))
        n = int(inside.sum())
        out.append({"band": f"{lo:.1f}-{hi:.1f}", "n": n, "share": n / max(1, k.size),
                    "kld_mean": float(k[inside].mean()) if n else None,
                    "top1_agreement": float(same[inside].mean()) if n else None})
    return out


def compare(ref: dict[str, np.ndarray], q: dict[str, np.ndarray], window_sizes: np.ndarray | None = None,
            ) -> dict[str, Any]:
    """All metrics of a variant's runner output ``q`` against the reference ``ref`` (both as saved by the
    runner protocol). ``q`` holds ``kld`` (exact) or ``at_ref_logprobs``/``at_ref_tail`` (top-K lower
    bound). ``window_sizes``: scored positions per window, for the window bootstrap (None: one window).

    Raises:
        ValueError: ``q`` and ``ref`` were not scored on the same positions, or ``q`` has no KLD input.
    """
    nq, nr = q["target_logprob"].shape[0], ref["target_logprob"].shape[0]
    if nq != nr:
        raise ValueError(f"variant scored {nq} positions, reference {nr}: not the same window set")
    sizes = np.asarray([nq] if window_sizes is None else window_sizes, dtype=np.int64)
    pq, pr = perplexity(q["target_logprob"]), perplexity(ref["target_logprob"])
    out: dict[str, Any] = {**{k: float(v) for k, v in pq.to_dict().items()}}
    out["ref_ppl"] = pr.ppl
    out["delta_ppl_pct"] = 100.0 * (pq.ppl / pr.ppl - 1.0)
    out.update(ln_ppl_ratio(ref["target_logprob"], q["target_logprob"]))
    if "kld" in q:
        kld, prefix = np.asarray(q["kld"], np.float64), "kld"
        out["kld_method"] = "full-vocabulary"
    elif "at_ref_logprobs" in q:
        kld, prefix = topk_lower_bound(ref, q), "kld_topk_lower_bound"
        out["kld_method"] = f"top{ref['topk_logprobs'].shape[1]}-lower-bound"
        out["ref_tail_mass_mean"] = float(np.exp(np.asarray(ref["tail_logprob"], np.float64)).mean())
    else:
        raise ValueError("the variant's output has neither kld (exact) nor at_ref_logprobs (top-K bound)")
    out.update(kld_summary(kld, prefix))
    out["top1_agreement"] = top1_agreement(ref["top1"], q["top1"])
    out.update(delta_p(ref["target_logprob"], q["target_logprob"]))
    started = time.perf_counter()
    if prefix == "kld":  # llama-perplexity's statistics are of the exact KLD; a bound gets none of them
        out.update(llama_perplexity_stats(ref, q, kld))
        if "topk_logprobs" in ref:
            out["kld_by_confidence"] = by_confidence(ref, q, kld)
    spent = time.perf_counter() - started
    out.update(_bootstrap(ref, q, kld, prefix, sizes))
    # what llama-perplexity's statistics, the confidence bands and the tail intervals cost (bench/stats_cost.py)
    out["statistics_s"] = spent + float(out.pop("_percentile_intervals_s", 0.0))
    return out


def _bootstrap(ref: dict[str, np.ndarray], q: dict[str, np.ndarray], kld: np.ndarray, prefix: str,
               sizes: np.ndarray) -> dict[str, Any]:
    """Window-bootstrap standard errors and 95 % intervals (see the module docstring)."""
    nll_q = -np.asarray(q["target_logprob"], np.float64)
    nll_r = -np.asarray(ref["target_logprob"], np.float64)
    boot = window_bootstrap({"nll": nll_q, "diff": nll_q - nll_r, "kld": kld}, sizes)
    out: dict[str, Any] = {"ci_method": CI_METHOD if boot["nll"].size else "none (one window)",
                           "n_windows": len(sizes)}
    se, lo, hi = _interval(boot["nll"], np.exp)
    out.update(nll_se=se, ppl_ci95_low=lo, ppl_ci95_high=hi)
    se, lo, hi = _interval(boot["diff"], lambda d: 100.0 * np.expm1(d))
    out.update(ln_ppl_ratio_se=se, delta_ppl_pct_ci95_low=lo, delta_ppl_pct_ci95_high=hi)
    se, lo, hi = _interval(boot["kld"])
    out.update({f"{prefix}_se": se, f"{prefix}_ci95_low": lo, f"{prefix}_ci95_high": hi})
    if prefix == "kld":
        started = time.perf_counter()
        out.update(percentile_intervals(kld, sizes))
        out["_percentile_intervals_s"] = time.perf_counter() - started
    return out


def percentile_intervals(values: np.ndarray, sizes: np.ndarray, resamples: int = PERCENTILE_RESAMPLES,
                         seed: int = BOOTSTRAP_SEED) -> dict[str, float | None]:
    """95 % window-bootstrap intervals of the gated KLD percentiles (:data:`GATED_PERCENTILES`): ``kld_p99_ci95_low``
    and ``…_high``, so that a gate on a tail is inconclusive where its limit lies inside the interval, as one on
    the mean is. None with one window."""
    v = np.asarray(values, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.int64)
    keys = [f"kld_{name}_ci95_{side}" for name, _ in GATED_PERCENTILES for side in ("low", "high")]
    if len(sizes) < 2:
        return dict.fromkeys(keys)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    windows = [v[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]
    idx = np.random.default_rng(seed).integers(0, len(sizes), size=(resamples, len(sizes)))
    qs = [q for _, q in GATED_PERCENTILES]
    samples = np.array([np.percentile(np.concatenate([windows[i] for i in row]), qs) for row in idx])
    out: dict[str, float | None] = {}
    for j, (name, _) in enumerate(GATED_PERCENTILES):
        lo, hi = np.percentile(samples[:, j], [2.5, 97.5])
        out[f"kld_{name}_ci95_low"], out[f"kld_{name}_ci95_high"] = float(lo), float(hi)
    return out
