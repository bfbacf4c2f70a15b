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
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import EngineError
from pipeline.llama_cpp import LlamaCppToolchain

#: llama-perplexity prints these with 6 decimals (the per-chunk lines with 5).
_FIELDS = {"ppl": r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", "ppl_base": r"Mean PPL\(base\)\s*:\s*([0-9.]+)",
           "kld_mean": r"Mean\s+KLD:\s*([0-9.]+)", "kld_median": r"Median\s+KLD:\s*([0-9.]+)",
           "same_top_pct": r"Same top p:\s*([0-9.]+)"}
PRINTED_DECIMALS = 6


@dataclass(frozen=True)
class LlamaKLD:
    """What ``llama-perplexity --kl-divergence`` printed (values as printed, 6 decimals)."""

    ppl: float
    ppl_base: float
    kld_mean: float
    kld_median: float
    same_top_pct: float
    wall_s: float


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
    return LlamaKLD(wall_s=wall, **found)


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
