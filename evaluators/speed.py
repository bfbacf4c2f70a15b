"""One definition per speed metric, for every engine. Standard library + numpy (and ``evaluators.protocol``):
runners import it in foreign interpreters (the tool environments).

A runner only records raw timestamps and counts, one :class:`Seq` per sequence, on one monotonic clock
(``time.perf_counter``, seconds), and calls the functions below; no runner computes a speed itself:

* ``t_submit``: the request is handed to the engine, before any of its prompt is processed;
* ``t_first``: the first generated token is available to the caller (prefill done, its last row's logits
  computed and the token picked);
* ``t_last``: the last generated token is available;
* ``n_prompt``, ``n_generated``: prompt tokens, generated tokens (the first one included).

The definitions (``DEFINITIONS``, recorded with every result as ``definitions``):

* **time to first token**, ms, batch 1: ``ttft_ms = 1000 · (t_first − t_submit)`` (prefill and the first
  token);
* **prompt processing**, tok/s, batch 1: ``prompt_tok_per_s = n_prompt / (t_first − t_submit)``, i.e.
  ``n_prompt / TTFT``: llama-bench's ``pp`` times the same prompt decode (it skips only picking the token);
* **decode**, tok/s, batch 1: ``decode_tok_per_s = (n_generated − 1) / (t_last − t_first)``, the tokens after
  the first over the time after the first (1 / TPOT, vLLM's "time per output token"). It is measured after
  the prompt, at depths ``n_prompt .. n_prompt + n_generated − 2``: llama-bench's ``tg{n_generated−1} @
  d{n_prompt}``, not its ``tg`` at an empty context;
* **aggregate** generated tok/s at N concurrent sequences, end to end:
  ``aggregate_tok_per_s = Σ n_generated / (max t_last − min t_submit)``, all N sequences submitted together
  (distinct prompts, no prefix caching), the wall time from submission to the last token, prefills included
  (vLLM's ``output_throughput``). From llama-batched-bench's JSONL (``pl`` sequences, ``pp`` prompt and
  ``tg`` decode steps each): ``pl · (tg + 1) / (t_pp + t_tg)`` (its prefill yields each sequence's first
  token, then ``tg`` steps: run it with ``-ntg G−1`` for G generated tokens); its own ``speed`` counts
  prompt tokens too and is not this;
* **decode-only aggregate** (secondary): ``decode_aggregate_tok_per_s = Σ (n_generated − 1) / (max t_last −
  max t_first)``: the decode phase after the last prefill. Exact where the N prefills finish together
  (llama.cpp's batched prefill: llama-batched-bench's ``speed_tg`` = ``pl · tg / t_tg``); where an engine
  interleaves prefills with decoding it overstates, since tokens decoded before the last prefill finished
  are counted.

Shapes: the seed benchmark's (:data:`SEED_SHAPE`, 512 prompt / 256 generated tokens) on a GPU; on CPU the
request is capped at :data:`CPU_SCALED_SHAPE` and labelled ``cpu-scaled`` (:func:`resolve_shape`). The
shape, the repeats and the engine's settings (:func:`engine_settings`) are part of every speed result.
Each metric is measured ``repeats`` times and reported as ``stats`` (median, min, max, n).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evaluators.protocol import stats

#: The version of the definitions above; results measured under other definitions are not comparable.
DEFINITIONS = "quantyard-speed/1"

#: The seed benchmark's shape (GPU): batch 1 on a 512-token prompt generating 256 tokens, and N concurrent
#: sequences of the same shape.
SEED_SHAPE: dict[str, int] = {"prompt_tokens": 512, "gen_tokens": 256,
                              "parallel_prompt_tokens": 512, "parallel_gen_tokens": 256}
#: Upper bounds on CPU, where the seed shape takes minutes per variant (N=32 × 768 tokens on a 2-core machine).
CPU_SCALED_SHAPE: dict[str, int] = {"prompt_tokens": 128, "gen_tokens": 32,
                                    "parallel_prompt_tokens": 64, "parallel_gen_tokens": 32}
SHAPE_KEYS = tuple(SEED_SHAPE)


@dataclass(frozen=True)
class Seq:
    """One sequence's timestamps (seconds, one monotonic clock) and token counts."""

    t_submit: float
    t_first: float
    t_last: float
    n_prompt: int
    n_generated: int

    def __post_init__(self) -> None:
        if not self.t_submit <= self.t_first <= self.t_last:
            raise ValueError(f"expected t_submit ≤ t_first ≤ t_last, got {self.t_submit}, {self.t_first}, "
                             f"{self.t_last}")
        if self.n_generated < 1 or self.n_prompt < 1:
            raise ValueError(f"expected at least 1 prompt and 1 generated token, got {self.n_prompt}, "
                             f"{self.n_generated}")

    def row(self, t0: float) -> list[float]:
        """``[t_first − t0, t_last − t0, n_prompt, n_generated]`` (seconds, 6 decimals) for the result."""
        return [round(self.t_first - t0, 6), round(self.t_last - t0, 6), self.n_prompt, self.n_generated]


def _positive(seconds: float, what: str) -> float:
    if seconds <= 0:
        raise ValueError(f"{what} must be positive to compute a rate, got {seconds!r} s")
    return seconds


def ttft_ms(s: Seq) -> float:
    """Time to first token, ms: ``1000 · (t_first − t_submit)``."""
    return 1000.0 * (s.t_first - s.t_submit)


def prompt_tok_per_s(s: Seq) -> float:
    """Prompt processing, tok/s: ``n_prompt / (t_first − t_submit)``."""
    return s.n_prompt / _positive(s.t_first - s.t_submit, "t_first − t_submit")


def decode_tok_per_s(s: Seq) -> float:
    """Decode at batch 1, tok/s: ``(n_generated − 1) / (t_last − t_first)``.

    Raises:
        ValueError: fewer than 2 generated tokens (no decode step was timed).
    """
    if s.n_generated < 2:
        raise ValueError(f"decode tok/s needs at least 2 generated tokens, got {s.n_generated}")
    return (s.n_generated - 1) / _positive(s.t_last - s.t_first, "t_last − t_first")


def aggregate_tok_per_s(seqs: Sequence[Seq]) -> float:
    """Aggregate generated tok/s of concurrent sequences, end to end:
    ``Σ n_generated / (max t_last − min t_submit)``."""
    wall = max(s.t_last for s in seqs) - min(s.t_submit for s in seqs)
    return sum(s.n_generated for s in seqs) / _positive(wall, "max t_last − min t_submit")


def decode_aggregate_tok_per_s(seqs: Sequence[Seq]) -> float:
    """Decode-only aggregate tok/s: ``Σ (n_generated − 1) / (max t_last − max t_first)`` (see the module
    docstring for where it is exact)."""
    wall = max(s.t_last for s in seqs) - max(s.t_first for s in seqs)
    return sum(s.n_generated - 1 for s in seqs) / _positive(wall, "max t_last − max t_first")


def single_stream(runs: Sequence[Seq]) -> dict[str, Any]:
    """Batch-1 metrics over repeated runs (one :class:`Seq` each): ``ttft_ms``, ``prompt_tok_per_s``,
    ``decode_tok_per_s`` as stats, and the raw ``runs`` (:meth:`Seq.row`, relative to each ``t_submit``)."""
    if not runs:
        raise ValueError("expected at least one timed run")
    return {"ttft_ms": stats([ttft_ms(s) for s in runs]),
            "prompt_tok_per_s": stats([prompt_tok_per_s(s) for s in runs]),
            "decode_tok_per_s": stats([decode_tok_per_s(s) for s in runs]),
            "runs": [s.row(s.t_submit) for s in runs]}


def concurrent(runs: Sequence[Sequence[Seq]]) -> dict[str, Any]:
    """Metrics of N concurrent sequences over repeated runs (each the N sequences of one run):
    ``aggregate_tok_per_s`` and ``decode_aggregate_tok_per_s`` as stats, the shape, and the raw ``runs``
    (rows relative to the run's first submission)."""
    if not runs or any(len(r) != len(runs[0]) or not r for r in runs):
        raise ValueError("expected runs of the same number (≥ 1) of sequences")
    first = runs[0]
    return {"aggregate_tok_per_s": stats([aggregate_tok_per_s(r) for r in runs]),
            "decode_aggregate_tok_per_s": stats([decode_aggregate_tok_per_s(r) for r in runs]),
            "n_sequences": len(first), "prompt_tokens": first[0].n_prompt, "gen_tokens": first[0].n_generated,
            "runs": [[s.row(min(x.t_submit for x in r)) for s in r] for r in runs]}


def resolve_shape(asked: dict[str, Any], accelerator: str) -> dict[str, Any]:
    """The speed request for an engine on ``accelerator`` (``cuda`` or ``cpu``) from ``asked`` (a SpeedSpec's
    ``prompt_tokens``, ``gen_tokens``, ``parallel_prompt_tokens``, ``parallel_gen_tokens``, ``repeats``,
    ``parallel`` and ``cpu_scaled``): the tokens as asked on a GPU, capped at :data:`CPU_SCALED_SHAPE` on CPU
    (unless ``cpu_scaled`` is false). ``shape`` labels it: ``seed`` (equal to :data:`SEED_SHAPE`),
    ``cpu-scaled`` (capped on CPU: anything else) or ``custom`` (any other shape run as asked)."""
    tokens = {k: int(asked[k]) for k in SHAPE_KEYS}
    scaled = accelerator != "cuda" and bool(asked.get("cpu_scaled", True))
    if scaled:
        tokens = {k: min(v, CPU_SCALED_SHAPE[k]) for k, v in tokens.items()}
    label = "seed" if tokens == SEED_SHAPE else "cpu-scaled" if scaled else "custom"
    return {**tokens, "repeats": int(asked["repeats"]), "parallel": [int(n) for n in asked["parallel"]],
            "shape": label, "accelerator": accelerator}


def engine_settings(*, dtype: Any, kernel: Any, cuda_graphs: Any, kv_cache: dict[str, Any],
                    threads: Any, **extra: Any) -> dict[str, Any]:
    """What every speed result records about how the engine ran (every key required; say ``n/a`` and why
    where one does not apply, e.g. CUDA graphs on CPU)."""
    return {"dtype": dtype, "kernel": kernel, "cuda_graphs": cuda_graphs, "kv_cache": kv_cache,
            "threads": threads, **extra}


def speed_result(shape: Mapping[str, Any], single: Sequence[Seq], parallel: Mapping[int, Sequence[Sequence[Seq]]],
                 settings: dict[str, Any], tool: str) -> dict[str, Any]:
    """The speed result every runner returns: batch-1 metrics (:func:`single_stream`) at the top level, the
    concurrent ones under ``parallel.by_parallel[N]`` (:func:`concurrent`), the shape (``shape`` label,
    token counts, repeats, N list: ``shape`` is a :func:`resolve_shape` request), ``definitions`` and
    ``engine_settings``; ``tool`` names what was timed."""
    out: dict[str, Any] = {"definitions": DEFINITIONS, **single_stream(single),
                           **{k: shape.get(k) for k in (*SHAPE_KEYS, "repeats")},
                           "shape": shape.get("shape") or "unlabelled",
                           "parallel_n": list(shape.get("parallel") or []),
                           "seed_shape": f"{SEED_SHAPE['prompt_tokens']}/{SEED_SHAPE['gen_tokens']}",
                           "engine_settings": settings, "tool": tool}
    if parallel:
        out["parallel"] = {"by_parallel": {str(n): concurrent(runs) for n, runs in parallel.items()}, "tool": tool}
    return out


def prompts(pool: np.ndarray, n: int, length: int) -> list[list[int]]:
    """``n`` different prompts of ``length`` ids cut one after another from ``pool`` (the window ids,
    repeated as needed), so that no two sequences share a prefix cache entry."""
    flat = np.asarray(pool).reshape(-1)
    reps = (length * (n + 1)) // max(1, flat.size) + 1
    flat = np.tile(flat, reps)
    return [flat[i * length:(i + 1) * length].tolist() for i in range(n)]


def comparable(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Why two speed results cannot be compared (different definitions or shape); empty when they can."""
    keys: Iterable[str] = ("definitions", *SHAPE_KEYS, "shape")
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


# --- the reference tools' numbers in these definitions ----------------------------------------------------


def from_llama_bench(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Batch-1 metrics from ``llama-bench -o json`` rows: a ``pp`` test (``n_prompt`` = P, ``n_gen`` = 0) and a
    ``tg`` test at depth P (``-p 0 -n G−1 -d P``). Per repetition (``samples_ns``): ``prompt_tok_per_s =
    n_prompt / t``, ``ttft_ms`` = its time (llama-bench does not pick the first token: a few µs less),
    ``decode_tok_per_s = n_gen / t``, which is ``(G − 1) / (t_last − t_first)`` of G generated tokens at the
    same depths. Returns stats of each.

    Raises:
        ValueError: no pp or no tg row.
    """
    pp = [r for r in rows if int(r.get("n_prompt", 0)) > 0 and int(r.get("n_gen", 0)) == 0]
    tg = [r for r in rows if int(r.get("n_gen", 0)) > 0 and int(r.get("n_prompt", 0)) == 0]
    if len(pp) != 1 or len(tg) != 1:
        raise ValueError(f"expected one pp and one tg row of llama-bench, got {len(pp)} and {len(tg)}")
    pp_s = [ns / 1e9 for ns in pp[0]["samples_ns"]]
    tg_s = [ns / 1e9 for ns in tg[0]["samples_ns"]]
    n_prompt, n_gen = int(pp[0]["n_prompt"]), int(tg[0]["n_gen"])
    return {"ttft_ms": stats([1000.0 * t for t in pp_s]), "prompt_tok_per_s": stats([n_prompt / t for t in pp_s]),
            "decode_tok_per_s": stats([n_gen / t for t in tg_s]), "prompt_tokens": n_prompt,
            "gen_tokens": n_gen + 1, "depth": int(tg[0].get("n_depth", 0))}


def from_batched_bench(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Concurrent metrics from repeated ``llama-batched-bench --output-format jsonl`` rows of one ``pl`` (run
    with ``-ntg G−1`` for G generated tokens): ``aggregate_tok_per_s = pl · (tg + 1) / (t_pp + t_tg)`` (its
    prefill yields each sequence's first token; its own ``speed`` also counts the prompt tokens) and
    ``decode_aggregate_tok_per_s = pl · tg / t_tg`` (its ``speed_tg``). Returns stats of each.

    Raises:
        ValueError: no rows, or rows of different shapes.
    """
    if not rows or len({(int(r["pl"]), int(r["pp"]), int(r["tg"])) for r in rows}) != 1:
        raise ValueError(f"expected llama-batched-bench rows of one shape, got {list(rows)!r}")
    pl, pp, tg = int(rows[0]["pl"]), int(rows[0]["pp"]), int(rows[0]["tg"])
    return {"aggregate_tok_per_s": stats([pl * (tg + 1) / (float(r["t_pp"]) + float(r["t_tg"])) for r in rows]),
            "decode_aggregate_tok_per_s": stats([pl * tg / float(r["t_tg"]) for r in rows]),
            "n_sequences": pl, "prompt_tokens": pp, "gen_tokens": tg + 1}
