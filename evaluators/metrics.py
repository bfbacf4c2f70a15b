"""Quality metrics of a variant against the unquantized reference, on the shared window set.

These are the figures ``llama-perplexity --kl-divergence`` reports (PPL, ln(PPL_q/PPL_ref),
KLD and its percentiles, "same top" %, Δp), computed on our shared windows so every engine
is comparable.

**KL-divergence from top-K plus tail.** The reference stores, per position, its top-K
log-probs ``log P(v)`` for ``v`` in ``T`` (its K most likely tokens) and the log of the
remaining mass ``log P(V∖T)``. Engines report ``log Q(v)`` for the same ids and
``log Q(V∖T)``. We compute KL over the K+1 bins ``{v₁..v_K, V∖T}``:

    KL_K(P‖Q) = Σ_{v∈T} P(v)·log(P(v)/Q(v)) + P(V∖T)·log(P(V∖T)/Q(V∖T)).

Merging outcomes never increases KL-divergence (log-sum inequality / data processing), so
``KL_K ≤ KL`` always: the approximation is a lower bound. The gap is the divergence of P and
Q *inside* the tail, weighted by the tail mass, ``P(V∖T)·KL(P|_tail ‖ Q|_tail)``; it is zero
when Q is proportional to P on the tail and vanishes as ``P(V∖T) → 0``. With full logits
(``K`` = vocabulary size, tail mass zero) the formula is the exact KL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


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
    """Perplexity ``exp(mean NLL)`` with the standard error of the mean NLL (nats/token)."""
    nll = -np.asarray(target_logprob, dtype=np.float64)
    n = int(nll.size)
    if n == 0:
        raise ValueError("perplexity of zero tokens is undefined")
    mean = float(nll.mean())
    se = float(nll.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return Perplexity(ppl=math.exp(mean), nll_mean=mean, nll_se=se, n_tokens=n)


def kld_per_position(ref_logprobs: np.ndarray, ref_tail: np.ndarray, q_logprobs: np.ndarray,
                     q_tail: np.ndarray) -> np.ndarray:
    """KL(P_ref ‖ Q) per position over the K+1 bins described in the module docstring (nats).

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


def kld_summary(kld: np.ndarray) -> dict[str, float]:
    kld = np.asarray(kld, dtype=np.float64)
    n = kld.size
    out = {"kld_mean": float(kld.mean()),
           "kld_se": float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")}
    out.update({f"kld_{k}": v for k, v in percentiles(kld).items()})
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


def compare(ref: dict[str, np.ndarray], q: dict[str, np.ndarray]) -> dict[str, float]:
    """All metrics of a variant's runner output ``q`` against the reference ``ref`` (both as saved
    by the runner protocol; ``q`` must contain ``at_ref_logprobs`` / ``at_ref_tail``)."""
    if q["target_logprob"].shape != ref["target_logprob"].shape:
        raise ValueError(f"variant scored {q['target_logprob'].shape[0]} positions, reference "
                         f"{ref['target_logprob'].shape[0]}: not the same window set")
    pq, pr = perplexity(q["target_logprob"]), perplexity(ref["target_logprob"])
    kld = kld_per_position(ref["topk_logprobs"], ref["tail_logprob"], q["at_ref_logprobs"], q["at_ref_tail"])
    out: dict[str, float] = {**{k: float(v) for k, v in pq.to_dict().items()}}
    out["ref_ppl"] = pr.ppl
    out["delta_ppl_pct"] = 100.0 * (pq.ppl / pr.ppl - 1.0)
    out.update(ln_ppl_ratio(ref["target_logprob"], q["target_logprob"]))
    out.update(kld_summary(kld))
    out["top1_agreement"] = top1_agreement(ref["top1"], q["top1"])
    out.update(delta_p(ref["target_logprob"], q["target_logprob"]))
    out["ref_tail_mass_mean"] = float(np.exp(np.asarray(ref["tail_logprob"], np.float64)).mean())
    return out
