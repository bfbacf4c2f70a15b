"""Runner side of the engine protocol. Standard library + numpy (and the stdlib-only ``pipeline.cpu`` and
``pipeline.fs``): runners execute in foreign interpreters (managed tool environments) that have neither
pydantic nor gguf.

A runner is started as ``python -m evaluators.<engine>.runner REQUEST.json``. The request holds
``model``, ``windows`` (npz from evaluators.windows), optional ``ref_topk`` (npz with
``topk_ids``), ``top_k``, ``threads``, ``out_dir`` and optional ``speed`` settings. The runner writes
``out_dir/logprobs.npz`` and, last, ``out_dir/result.json``; a missing ``result.json`` means the
runner died.

Per scored position (window-major order, see WindowSet) ``logprobs.npz`` holds:

* ``target_logprob`` float64 [N]: log p(actual next token);
* ``top1`` int32 [N]: the engine's most likely token;
* ``topk_ids`` int32 [N,K], ``topk_logprobs`` float32 [N,K], ``tail_logprob`` float64 [N]: the engine's
  own top-K and the log of the probability mass outside it (what a reference stores) — written when no
  ``ref_topk`` is given; a variant scored against a reference does not need them (they cost a top-K
  selection over the vocabulary per position), unless the request sets ``own_topk``;
* with ``ref_topk``: ``at_ref_logprobs`` float32 [N,K] and ``at_ref_tail`` float64 [N]: the engine's
  log-probs at the *reference's* top-K ids and the log of its mass outside those ids, which is what
  KL-divergence against the reference needs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.cpu import cpu_flags
from pipeline.fs import atomic_path, write_atomic

BLOCK = 128  # positions per vectorised block: bounds memory at BLOCK x vocab floats


def read_request() -> dict[str, Any]:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {sys.argv[0]} REQUEST.json")
    return dict(json.loads(Path(sys.argv[1]).read_text()))


def load_windows(path: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return z["ids"].astype(np.int64), z["score_start"].astype(np.int64)


def load_ref_ids(path: str | None) -> np.ndarray | None:
    if not path:
        return None
    with np.load(path, allow_pickle=False) as z:
        return z["topk_ids"].astype(np.int64)


def _logsumexp(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):  # an empty mass is log(0) = -inf, by design
        out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return np.squeeze(out, axis=axis)


REST_FLOOR = 1e-12


def _log_rest(lp: np.ndarray) -> np.ndarray:
    """log(1 − Σ exp(lp)) per row, in float64: the log of the mass outside the given tokens.

    Computing it from the K log-probs (not by summing the rest of the vocabulary) is O(K). The log-probs
    come from float32 logits minus a float64 log-sum-exp (or are float64 already), so float64
    cancellation leaves ~1e-15 of noise, so a rest below REST_FLOOR (1e-12) is stored as the floor:
    with full logits both sides then hold the floor and the tail term of the KLD is exactly 0; in
    general the floor changes a KLD by less than 1e-12 · |Δ log| nats.
    """
    rest = 1.0 - np.exp(lp).sum(axis=1)
    return np.log(np.maximum(rest, REST_FLOOR))


class Collector:
    """Accumulates per-position outputs from full logits, window by window."""

    def __init__(self, top_k: int, ref_ids: np.ndarray | None, own_topk: bool | None = None) -> None:
        self.top_k = top_k
        self.ref_ids = ref_ids
        self.own_topk = ref_ids is None if own_topk is None else own_topk
        self.cursor = 0
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in (
            "target_logprob", "top1", "topk_ids", "topk_logprobs", "tail_logprob", "at_ref_logprobs",
            "at_ref_tail")}

    def add_window(self, logits: np.ndarray, ids: np.ndarray, start: int) -> None:
        """``logits`` [W, V] for window ids [W]; row i-1 predicts ids[i] for i >= start."""
        self.add_rows(logits[start - 1: len(ids) - 1], ids[start:])

    def add_rows(self, rows: np.ndarray, targets: np.ndarray, pool: Executor | None = None) -> None:
        """``rows`` [N, V] of logits, row j predicting ``targets[j]`` (only the scored rows). With ``pool``,
        blocks of rows are scored in parallel (numpy releases the GIL); results keep their order."""
        if len(rows) != len(targets):
            raise SystemExit(f"{len(rows)} logit rows for {len(targets)} targets")
        self._add(rows, targets, False, pool)

    def add_logprobs(self, lp: np.ndarray, targets: np.ndarray) -> None:
        """Add rows that are already log-probabilities (e.g. from an engine that returns them)."""
        self._add(lp, targets, True, None)

    def _add(self, rows: np.ndarray, targets: np.ndarray, normalised: bool, pool: Executor | None) -> None:
        n = len(targets)
        ref = None
        if self.ref_ids is not None:
            ref = self.ref_ids[self.cursor:self.cursor + n]
            if len(ref) != n:
                raise SystemExit(f"reference has {len(self.ref_ids)} positions, fewer than the window set")
        jobs = [(rows[b:b + BLOCK], targets[b:b + BLOCK], None if ref is None else ref[b:b + BLOCK], normalised)
                for b in range(0, n, BLOCK)]
        outs = pool.map(lambda job: self._block(*job), jobs) if pool is not None and len(jobs) > 1 else \
            [self._block(*job) for job in jobs]
        for out in outs:
            for key, value in out.items():
                self.parts[key].append(value)
        self.cursor += n

    def _block(self, rows: np.ndarray, targets: np.ndarray, ref: np.ndarray | None,
               normalised: bool) -> dict[str, np.ndarray]:
        n = len(targets)
        if normalised:
            # Log-probs keep their precision: rounding normalised float64 log-probs to float32 would break
            # Σ p = 1 by ~1e-7, which a small mass outside the top-K (1 − Σ p_topk) cannot absorb.
            x = np.ascontiguousarray(rows, dtype=np.float64 if rows.dtype == np.float64 else np.float32)
            lse = np.zeros(n)
        else:
            x = np.ascontiguousarray(rows, dtype=np.float32)  # engines' logits are float32: that is the truth
            # exp in float32, accumulated in float64: measured on the demo's logits, the KLD agrees with
            # an all-float64 computation to 2e-16 relative, at half the cost.
            m = x.max(axis=1)
            e = np.subtract(x, m[:, None])
            np.exp(e, out=e)
            lse = m.astype(np.float64) + np.log(e.sum(axis=1, dtype=np.float64))
        out = {"target_logprob": x[np.arange(n), targets].astype(np.float64) - lse,
               "top1": np.argmax(x, axis=1).astype(np.int32)}
        if self.own_topk:
            k = min(self.top_k, x.shape[1])
            part = np.argpartition(x, x.shape[1] - k, axis=1)[:, -k:]
            part_lp = np.take_along_axis(x, part, axis=1).astype(np.float64) - lse[:, None]
            order = np.argsort(-part_lp, axis=1, kind="stable")
            topk_lp = np.take_along_axis(part_lp, order, axis=1)
            out["topk_ids"] = np.take_along_axis(part, order, axis=1).astype(np.int32)
            out["topk_logprobs"] = topk_lp.astype(np.float32)
            out["tail_logprob"] = _log_rest(topk_lp)
        if ref is not None:
            at_ref = np.take_along_axis(x, ref, axis=1).astype(np.float64) - lse[:, None]
            out["at_ref_logprobs"] = at_ref.astype(np.float32)
            out["at_ref_tail"] = _log_rest(at_ref)
        return out

    def save(self, out_dir: Path) -> int:
        # Any: np.savez's stub types **kwds against its allow_pickle: bool too; the keys are the fixed names above.
        arrays: dict[str, Any] = {k: np.concatenate(v) for k, v in self.parts.items() if v}
        with atomic_path(out_dir / "logprobs.npz") as tmp, tmp.open("wb") as fh:  # a file object: no .npz added
            np.savez(fh, **arrays)
        return self.cursor


def hardware(threads: int | None = None) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            gpu = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "gpu": gpu,
            "machine": platform.machine(), "system": platform.system(), "cpu_flags": cpu_flags()}


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median": float(np.median(s)), "min": float(s[0]), "max": float(s[-1]), "n": len(s)}


def write_result(out_dir: Path, result: dict[str, Any]) -> None:
    """Write result.json atomically; it is the runner's 'I finished' signal."""
    write_atomic(out_dir / "result.json", json.dumps(result, indent=2))


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0
