"""``llama-perplexity --kl-divergence`` of the same llama.cpp build, as the yardstick for Quantyard's numbers.

llama.cpp's own two-step KL-divergence: ``--kl-divergence-base FILE`` with the base model stores, per chunk of
``-c`` tokens, the second half's log-probs (16-bit, over 16 nats below each position's top); ``--kl-divergence``
with a quantized model then prints the mean KLD over those positions. It tokenizes the text itself and
overwrites each chunk's first token with BOS: the positions Quantyard scores with ``--window 512 --stride 512
--score-from 257`` (see evaluators/windows.py). Used by tests and ``bench/`` to check that Quantyard's exact
KLD is llama.cpp's, never by the pipeline itself.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import EngineError
from pipeline.llama_cpp import LlamaCppToolchain

#: llama-perplexity prints these with 6 decimals (the per-chunk lines with 5).
_FIELDS = {"ppl": r"Mean PPL\(Q\)\s*:\s*(-?[0-9.]+)", "ppl_base": r"Mean PPL\(base\)\s*:\s*(-?[0-9.]+)",
           "kld_mean": r"Mean\s+KLD:\s*(-?[0-9.]+)", "kld_median": r"Median\s+KLD:\s*(-?[0-9.]+)",
           "same_top_pct": r"Same top p:\s*(-?[0-9.]+)"}
PRINTED_DECIMALS = 6


@dataclass(frozen=True)
class LlamaKLD:
    """What ``llama-perplexity --kl-divergence`` printed (values as printed, 6 decimals); ``stats``: every statistic
    it printed (:func:`printed_statistics`)."""

    ppl: float
    ppl_base: float
    kld_mean: float
    kld_median: float
    same_top_pct: float
    wall_s: float
    stats: dict[str, tuple[float, float]] = field(default_factory=dict)


ATTEMPTS = 8


def _run(tools: LlamaCppToolchain, args: list[str], want: tuple[str, ...], timeout_s: float) -> tuple[str, float]:
    """Run llama-perplexity until its output holds every pattern of ``want`` (llama.cpp's asynchronous logger
    loses the end of the output when the process exits before its thread has printed it: seen here in about
    half the runs on a loaded 2-core machine, the output cut mid-line; a run without them is repeated, at
    most ``ATTEMPTS`` times); ``want`` empty: once, a zero exit is enough."""
    import time

    cmd = [str(tools.exe("llama-perplexity")), *args]
    out = ""
    for _ in range(ATTEMPTS):
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=tools.env(), timeout=timeout_s)
        wall = time.perf_counter() - t0
        out = res.stdout + res.stderr
        if res.returncode != 0:
            raise EngineError(f"llama-perplexity exited {res.returncode}", engine="llama.cpp",
                              returncode=res.returncode, stderr_tail=out[-3000:])
        if all(re.search(w, out) for w in want):
            return out, wall
    raise EngineError(f"llama-perplexity printed no {want!r} in {ATTEMPTS} runs; its output ended: {out[-800:]!r}",
                      engine="llama.cpp", stderr_tail=out[-3000:])


def save_base(tools: LlamaCppToolchain, base: Path, text: Path, out: Path, *, ctx: int, chunks: int,
              threads: int, timeout_s: float = 3600) -> float:
    """``--kl-divergence-base``: store the base model's log-probs of ``chunks`` chunks of ``text``; returns
    the seconds it took (llama.cpp's reference pass)."""
    out.unlink(missing_ok=True)
    _, wall = _run(tools, ["-m", str(base), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks),
                           "-t", str(threads), "-tb", str(threads), "--kl-divergence-base", str(out)], (), timeout_s)
    if not out.is_file() or out.stat().st_size == 0:
        raise EngineError(f"llama-perplexity --kl-divergence-base wrote no {out}", engine="llama.cpp")
    return wall


def kl_divergence(tools: LlamaCppToolchain, model: Path, base_file: Path, *, threads: int,
                  timeout_s: float = 3600) -> LlamaKLD:
    """``--kl-divergence`` of ``model`` against a stored base (same chunks); the printed statistics."""
    out, wall = _run(tools, ["-m", str(model), "--kl-divergence-base", str(base_file), "--kl-divergence",
                             "-t", str(threads), "-tb", str(threads)], tuple(_FIELDS.values()), timeout_s)
    found = {}
    for key, pattern in _FIELDS.items():
        m = re.search(pattern, out)
        if m is None:
            raise EngineError(f"llama-perplexity --kl-divergence printed no {key}", engine="llama.cpp",
                              stderr_tail=out[-3000:])
        found[key] = float(m.group(1))
    return LlamaKLD(wall_s=wall, stats=printed_statistics(out), **found)


#: Every statistic ``llama-perplexity --kl-divergence`` prints (tools/perplexity/perplexity.cpp of the pinned
#: llama.cpp), by its label, as Quantyard's quality-metric key (evaluators/metrics.py) and the scale from what is
#: printed to that key's unit (percentages are printed ×100). A ``± x`` after a value is the key's ``*_unc``.
PRINTED: tuple[tuple[str, str, float], ...] = (
    (r"Mean PPL\(Q\)\s*", "ppl", 1.0), (r"Mean PPL\(base\)\s*", "ref_ppl", 1.0),
    (r"Cor\(ln\(PPL\(Q\)\), ln\(PPL\(base\)\)\)", "ln_ppl_cor", 0.01),
    (r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*", "ln_ppl_ratio", 1.0),
    (r"Mean PPL\(Q\)/PPL\(base\)\s*", "ppl_ratio", 1.0), (r"Mean PPL\(Q\)-PPL\(base\)\s*", "ppl_diff", 1.0),
    (r"Mean\s+KLD", "kld_mean", 1.0), (r"Maximum KLD", "kld_max", 1.0), (r"99\.9%\s+KLD", "kld_p999", 1.0),
    (r"99\.0%\s+KLD", "kld_p99", 1.0), (r"95\.0%\s+KLD", "kld_p95", 1.0), (r"90\.0%\s+KLD", "kld_p90", 1.0),
    (r"Median\s+KLD", "kld_median", 1.0), (r"10\.0%\s+KLD", "kld_p10", 1.0), (r" 5\.0%\s+KLD", "kld_p5", 1.0),
    (r" 1\.0%\s+KLD", "kld_p1", 1.0), (r" 0\.1%\s+KLD", "kld_p01", 1.0), (r"Minimum KLD", "kld_min", 1.0),
    (r"Mean\s+Δp", "delta_p_mean", 0.01), (r"Maximum Δp", "delta_p_max", 0.01), (r"99\.9%\s+Δp", "delta_p_p999", 0.01),
    (r"99\.0%\s+Δp", "delta_p_p99", 0.01), (r"95\.0%\s+Δp", "delta_p_p95", 0.01), (r"90\.0%\s+Δp", "delta_p_p90", 0.01),
    (r"75\.0%\s+Δp", "delta_p_p75", 0.01), (r"Median\s+Δp", "delta_p_median", 0.01),
    (r"25\.0%\s+Δp", "delta_p_p25", 0.01), (r"10\.0%\s+Δp", "delta_p_p10", 0.01), (r" 5\.0%\s+Δp", "delta_p_p5", 0.01),
    (r" 1\.0%\s+Δp", "delta_p_p1", 0.01), (r" 0\.1%\s+Δp", "delta_p_p01", 0.01), (r"Minimum Δp", "delta_p_min", 0.01),
    (r"RMS Δp\s*", "delta_p_rms", 0.01), (r"Same top p", "top1_agreement", 0.01),
)
_NUMBER = r"(-?[0-9]+\.([0-9]+))"


def printed_statistics(output: str) -> dict[str, tuple[float, float]]:
    """Every statistic of :data:`PRINTED` in a ``llama-perplexity --kl-divergence`` output, as Quantyard's key →
    (value in the key's unit, half a unit of its last printed digit in the same unit: how precisely it is known);
    an uncertainty printed after ``±`` as ``KEY_unc``. Lines it did not print are left out."""
    out: dict[str, tuple[float, float]] = {}
    for label, key, scale in PRINTED:
        m = re.search(rf"^{label}\s*:\s*{_NUMBER}(?:\s*±\s*{_NUMBER})?", output, re.M)
        if m is None:
            continue
        out[key] = (float(m.group(1)) * scale, 0.5 * 10.0 ** -len(m.group(2)) * scale)
        if m.group(3) is not None:
            out[f"{key}_unc"] = (float(m.group(3)) * scale, 0.5 * 10.0 ** -len(m.group(4)) * scale)
    return out


#: The relative agreement asked of a KLD compared with llama-perplexity's: 1 %, and 2 % below a mean KLD of 1e-4
#: (the demo's Q8_0, about 1.8e-5). There llama-perplexity prints two significant digits (±3 %), and its base,
#: stored as 16-bit log-probabilities over 16 nats with the tokens below −16 clipped, is coarse against the
#: difference measured; measured on an Intel AVX-512 machine (2026-12-02): Quantyard 1.747e-5 (transformers
#: reference) and 1.732e-5 (the same F16 base on llama.cpp) against a printed 0.000018, at least 0.2 % and 1.05 %
#: apart; every KLD above 1e-4 there agreed within 1 %.
REL_AGREEMENT = 0.01
REL_AGREEMENT_TINY = 0.02
TINY_KLD = 1e-4


def agreement_tolerance(value: float, rel: float | None = None, ours: float | None = None) -> float:
    """How far a number may be from ``value``, printed by llama-perplexity, and agree with it within ``rel``
    (default: :data:`REL_AGREEMENT`, :data:`REL_AGREEMENT_TINY` below :data:`TINY_KLD`). The printed ``value``
    stands for any number within half a unit ``h`` of its last digit (a KLD of 1.2e-5 printed as 0.000012 is
    known to ±4 %), so a number below it agrees when within ``rel`` of ``value - h``, one above when within
    ``rel`` of ``value + h``: the tolerance is ``h + rel·(value ∓ h)``, on the side of ``ours`` (the upper one
    when None)."""
    h = 0.5 * 10.0**-PRINTED_DECIMALS
    if rel is None:
        rel = REL_AGREEMENT_TINY if abs(value) < TINY_KLD else REL_AGREEMENT
    below = ours is not None and ours < value
    return h + rel * max(abs(value) + (-h if below else h), 0.0)
