"""Runner side of the engine protocol. Standard library + numpy (and the stdlib-only ``pipeline.cpu`` and
``pipeline.fs``): runners execute in foreign interpreters (managed tool environments) that have neither
pydantic nor gguf.

A runner is started as ``python -m evaluators.<engine>.runner REQUEST.json``. The request holds
``model``, ``windows`` (npz from evaluators.windows), optional ``reference`` (the reference's npz, see
below), ``kld`` (``full``, the default, or ``topk``), ``top_k``, ``threads``, ``out_dir``, optional
``store_full`` (the reference runner: keep the whole distribution) and optional ``speed`` settings. The
runner writes ``out_dir/logprobs.npz`` and, last, ``out_dir/result.json``; a missing ``result.json``
means the runner died.

Per scored position (window-major order, see WindowSet) ``logprobs.npz`` holds:

* ``target_logprob`` float64 [N]: log p(actual next token);
* ``top1`` int32 [N]: the engine's most likely token;
* ``topk_ids`` int32 [N,K], ``topk_logprobs`` float32 [N,K], ``tail_logprob`` float64 [N]: the engine's
  own top-K and the log of the probability mass outside it: written when no ``reference`` is given (the
  reference runner) or when the request sets ``own_topk``;
* with ``store_full``, the whole distribution, rounded the way ``llama-perplexity --kl-divergence-base``
  stores it (see :func:`encode_rows`): ``full_codes`` uint16 [N,V], ``full_lo`` and ``full_step`` float32
  [N]. ``full_codes`` is an uncompressed npz member, read in place (memory-mapped) by
  :class:`Reference`;
* with a ``reference`` and ``kld="full"``: ``kld`` float64 [N], the exact KL(P_ref ‖ Q) over the whole
  vocabulary (:func:`kld_rows`);
* with a ``reference`` and ``kld="topk"``: ``at_ref_logprobs`` float32 [N,K] and ``at_ref_tail`` float64
  [N]: the engine's log-probs at the *reference's* top-K ids and the log of its mass outside them, from
  which evaluators.metrics computes the cheaper top-K lower bound (``kld_topk_lower_bound``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import zipfile
from concurrent.futures import Executor
from pathlib import Path
from typing import IO, Any

import numpy as np

from pipeline.cpu import cpu_flags
from pipeline.fs import atomic_path, write_atomic

BLOCK = 128  # most positions per vectorised block
BLOCK_ELEMENTS = 1 << 21  # and at most this many logits per block: bounds memory at any vocabulary size


def block_rows(vocab: int) -> int:
    """Positions per block for a vocabulary of ``vocab``: 128 on small vocabularies, fewer on large ones
    (8 at 262,144), so that each temporary array holds at most ``BLOCK_ELEMENTS`` floats (8 MB)."""
    return max(1, min(BLOCK, BLOCK_ELEMENTS // max(1, vocab)))


#: Blocks per top-K entry in :func:`top_k_rows`' bound: more blocks, a tighter bound (fewer candidates), a
#: dearer bound. 16 left 32 to 76 candidates per row for the top 32 of SmolLM2's 49,152 logits.
TOPK_BLOCKS_PER_K = 16
#: Rows with more candidates than this (flat rows, mostly -inf rows) are sorted whole instead.
TOPK_MAX_CANDIDATES = 4096


def top_k_rows(x: np.ndarray, k: int) -> np.ndarray:
    """The column ids of each row's ``k`` largest values, int64 [n, k], largest first, equal values in
    ascending id order (also at the ``k``-th value: which of equal values make the cut is fixed).

    Selecting over the whole row (``np.argpartition``) is most of a reference's scoring cost at a 49k
    vocabulary. Instead: cut the row into ``TOPK_BLOCKS_PER_K * k`` blocks and take the ``k``-th largest of
    their maxima. ``k`` blocks hold a value at least that large, so the row's ``k``-th largest value is at
    least as large too, and every value of the top ``k`` is at or above it: only those candidates (a few
    dozen, usually) are sorted. Measured on SmolLM2-135M's logits (255 rows × 49,152, top 32): 0.034 s
    against 0.10 s for ``np.argpartition`` (which, besides, breaks ties at the K-th value arbitrarily).
    Rows holding NaN, rows with more than ``TOPK_MAX_CANDIDATES`` candidates and vocabularies too small
    to block are sorted whole (:func:`_top_k_sorted`; NaN sorts last).
    """
    n, v = x.shape
    k = min(k, v)
    width = v // (TOPK_BLOCKS_PER_K * k) if k else 0
    if n == 0 or width < 2:
        return _top_k_sorted(x, k)
    whole = (v // width) * width
    maxima = x[:, :whole].reshape(n, whole // width, width).max(axis=2)
    if whole < v:
        maxima = np.concatenate([maxima, x[:, whole:].max(axis=1, keepdims=True)], axis=1)
    bound = np.partition(maxima, maxima.shape[1] - k, axis=1)[:, maxima.shape[1] - k]
    rows, cols = np.nonzero(x >= bound[:, None])  # row-major: ascending ids within a row
    counts = np.bincount(rows, minlength=n)
    slow = np.isnan(maxima).any(axis=1) | (counts > TOPK_MAX_CANDIDATES) | (counts < k)
    out = np.empty((n, k), dtype=np.int64)
    if slow.any():
        out[slow] = _top_k_sorted(x[slow], k)
        keep = ~slow[rows]
        rows, cols = rows[keep], cols[keep]
        counts[slow] = 0
    fast = np.flatnonzero(~slow)
    if len(fast):
        width_c = int(counts.max())
        starts = np.cumsum(counts) - counts
        slot = np.arange(len(rows)) - starts[rows]
        values = np.full((n, width_c), -np.inf, dtype=np.float64)
        ids = np.zeros((n, width_c), dtype=np.int64)
        values[rows, slot] = x[rows, cols]
        ids[rows, slot] = cols
        order = np.argsort(-values[fast], axis=1, kind="stable")[:, :k]  # candidates first: padding is -inf last
        out[fast] = np.take_along_axis(ids[fast], order, axis=1)
    return out


def _top_k_sorted(x: np.ndarray, k: int) -> np.ndarray:
    """:func:`top_k_rows` by sorting whole rows (a stable sort: equal values in id order; NaN last)."""
    return np.argsort(-x.astype(np.float64), axis=1, kind="stable")[:, :k]


def read_request() -> dict[str, Any]:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {sys.argv[0]} REQUEST.json")
    return dict(json.loads(Path(sys.argv[1]).read_text()))


def load_windows(path: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return z["ids"].astype(np.int64), z["score_start"].astype(np.int64)


def window_sizes(windows: str | Path) -> np.ndarray:
    """Scored positions per window of a window file (what the window bootstrap resamples; their sum is the
    number of positions a run scores)."""
    with np.load(windows, allow_pickle=False) as z:
        return (int(z["ids"].shape[1]) - z["score_start"].astype(np.int64)).astype(np.int64)


# --- the reference's whole distribution -----------------------------------------------------------------

#: The reference's log-probs are stored per position on a uniform 16-bit grid below the position's largest
#: logit, as ``llama-perplexity --kl-divergence-base`` stores them, but over ``FULL_RANGE`` nats where
#: llama.cpp uses 16. Code 0 is a logit of -inf (probability exactly 0); codes 1..65535 map
#: ``lo .. 0`` (``lo = max(min logit − max logit, −FULL_RANGE)``), so the grid step is at most
#: ``FULL_RANGE / 65534`` = 6.1e-4 nats. Decoded and renormalised, the stored distribution P̃ differs from
#: the reference P by a rounding of at most half a step in each log-prob: the KL-divergence computed from
#: P̃ differs from the exact one by about KL(P̃ ‖ P) ≈ step²/24 ≤ 1.6e-8 nats plus a zero-mean term, far
#: below any quantization's KLD. A token more than ``FULL_RANGE`` nats below the top is stored at ``lo``
#: (a share of at most e^-40 each: 1e-12 of the mass at a 262,144-token vocabulary).
FULL_RANGE = 40.0
FULL_STEPS = 65534


def encode_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logits (or log-probs: only differences matter) [n, V] → (codes uint16 [n, V], lo float32 [n],
    step float32 [n]); see :data:`FULL_RANGE`."""
    y = np.asarray(x, dtype=np.float32)
    y = y - y.max(axis=1, keepdims=True)  # a new array: the steps below work in place on it
    low = y.min(axis=1)
    masked = np.flatnonzero(~np.isfinite(low))  # rows holding -inf (or NaN): their lowest finite value instead
    finite = np.isfinite(y[masked])
    if len(masked):
        low[masked] = np.where(finite, y[masked], 0.0).min(axis=1)
    lo = np.maximum(low, -FULL_RANGE).astype(np.float32)
    step = (-lo / FULL_STEPS).astype(np.float32)
    inv = np.divide(1.0, step, out=np.zeros_like(step), where=step > 0)
    with np.errstate(invalid="ignore"):
        y -= lo[:, None]
        y *= inv[:, None]
        np.rint(y, out=y)
        y += 1.0
    np.clip(y, 1.0, FULL_STEPS + 1.0, out=y)
    if len(masked):
        rows = y[masked]
        rows[~finite] = 0.0
        y[masked] = rows
    return y.astype(np.uint16), lo, step


def decode_rows(codes: np.ndarray, lo: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The stored log-probs, up to a constant per row (float32 [n, V]; -inf where the code is 0)."""
    a = np.subtract(np.asarray(codes), np.float32(1.0), dtype=np.float32)  # cast and shift in one pass
    a *= np.asarray(step, dtype=np.float32)[:, None]
    a += np.asarray(lo, dtype=np.float32)[:, None]
    if a.size and int(np.asarray(codes).min()) == 0:
        a[np.asarray(codes) == 0] = -np.inf
    return a


def kld_rows(x: np.ndarray, codes: np.ndarray, lo: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Exact KL(P̃_ref ‖ Q) per position over the whole vocabulary (nats, float64 [n]).

    ``x``: the engine's logits (or log-probs) [n, V]; ``codes, lo, step``: the reference's stored rows
    (:func:`encode_rows`). With ``a`` the decoded reference and ``b = x − max x``, both unnormalised:

        KL = Σᵢ e^{aᵢ}(aᵢ − bᵢ) / Zₐ − log Zₐ + log Z_b,   Zₐ = Σ e^{aᵢ},  Z_b = Σ e^{bᵢ}.

    Exponentials in float32, sums in float64: a uniform relative error of the float32 ``exp`` cancels
    between the two ``log Z``, and the ratio is that of the same rounded weights.
    """
    b = np.asarray(x, dtype=np.float32)
    b = b - b.max(axis=1, keepdims=True)
    part = kld_reference_part(b, codes, lo, step)
    np.exp(b, out=b)
    return np.maximum(part + np.log(b.sum(axis=1, dtype=np.float64)), 0.0)


def kld_reference_part(b: np.ndarray, codes: np.ndarray, lo: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``Σᵢ e^{aᵢ}(aᵢ − bᵢ) / Zₐ − log Zₐ`` per row (float64 [n]) for ``b`` = the engine's logits minus their
    row maximum (float32, left unchanged): the KL-divergence of :func:`kld_rows` is this plus ``log Z_b``, so a
    caller that sums ``e^b`` anyway (the Collector, for the log-probs) adds it without a second pass."""
    a = decode_rows(codes, lo, step)
    ea = np.exp(a)
    with np.errstate(invalid="ignore"):  # -inf in the reference (P = 0) gives NaN terms, redone below
        d = np.subtract(a, b, out=a)
        d *= ea
    s = d.sum(axis=1, dtype=np.float64)
    bad = np.flatnonzero(np.isnan(s))
    if len(bad):  # rows where the reference masks a token: it adds no term there (-inf in the engine only: +inf)
        e_bad = ea[bad]
        with np.errstate(invalid="ignore"):
            d_bad = decode_rows(np.asarray(codes)[bad], np.asarray(lo)[bad], np.asarray(step)[bad]) - b[bad]
        d_bad[e_bad == 0] = 0.0
        d_bad *= e_bad
        s[bad] = d_bad.sum(axis=1, dtype=np.float64)
    za = ea.sum(axis=1, dtype=np.float64)
    result: np.ndarray = s / za - np.log(za)
    return result


def npz_member(path: Path, name: str) -> np.memmap:
    """An uncompressed ``.npy`` member of an npz file, memory-mapped in place (read-only).

    Raises:
        ValueError: ``name`` is not a stored (uncompressed) member.
    """
    import struct

    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(f"{name}.npy")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: member {name} is compressed and cannot be memory-mapped")
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        local = fh.read(30)
        if local[:4] != b"PK\x03\x04":
            raise ValueError(f"{path}: no local zip header for member {name}")
        n_name, n_extra = struct.unpack("<HH", local[26:30])
        fh.seek(info.header_offset + 30 + n_name + n_extra)
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        offset = fh.tell()
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


class Reference:
    """A reference's npz as a variant's runner reads it: the top-K ids (for the top-K lower bound) and, for
    the exact KLD, the whole stored distribution, memory-mapped (it may be larger than memory)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with np.load(self.path, allow_pickle=False) as z:
            names = set(z.files)
            self.topk_ids = z["topk_ids"].astype(np.int64) if "topk_ids" in names else None
            self.has_full = "full_codes" in names
            self.lo = z["full_lo"] if self.has_full else None
            self.step = z["full_step"] if self.has_full else None
            self.n = int(z["target_logprob"].shape[0]) if "target_logprob" in names else 0
        self.codes = npz_member(self.path, "full_codes") if self.has_full else None

    @property
    def vocab(self) -> int | None:
        return None if self.codes is None else int(self.codes.shape[1])

    def rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stored rows of positions ``a..b-1``: (codes, lo, step)."""
        assert self.codes is not None and self.lo is not None and self.step is not None
        return np.asarray(self.codes[a:b]), self.lo[a:b], self.step[a:b]


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
    with full logits both sides then hold the floor and the tail term of the top-K bound is exactly 0; in
    general the floor changes it by less than 1e-12 · |Δ log| nats.
    """
    rest = 1.0 - np.exp(lp).sum(axis=1)
    return np.log(np.maximum(rest, REST_FLOOR))


KLD_MODES = ("full", "topk")


def report_progress(unit: str, done: int, total: int, tokens: int | None = None) -> None:
    """Say on stderr where the runner is (``quantyard-progress windows 3/8 tokens=1536``): the orchestrating
    process reads it while the runner works (pipeline/progress.py ``runner_line``) and shows it."""
    extra = f" tokens={tokens}" if tokens is not None else ""
    print(f"quantyard-progress {unit} {done}/{total}{extra}", file=sys.stderr, flush=True)


class Collector:
    """Accumulates per-position outputs from logits (or log-probs), window by window.

    ``reference``: what a variant is scored against (None for the reference itself). ``kld``: ``full``
    (exact, needs the reference's stored distribution) or ``topk`` (the log-probs at the reference's top-K
    ids, for the top-K lower bound). ``store_full`` (the reference runner): the folder whose
    ``logprobs.npz`` keeps the whole distribution, with ``rows`` the number of positions the run will add
    (the sum of :func:`window_sizes` of its window file). The codes stream straight into the npz's
    ``full_codes`` member, in a partial file that :meth:`save` completes and renames into place, so the
    distribution (1.6 GB for 64 windows of a 49k vocabulary) is written once and never copied.
    """

    def __init__(self, top_k: int, reference: Reference | np.ndarray | None, own_topk: bool | None = None,
                 kld: str | None = None, store_full: Path | None = None, rows: int | None = None) -> None:
        if kld is None:  # what the reference allows: exact with a stored distribution, else the top-K bound
            kld = "full" if isinstance(reference, Reference) and reference.has_full else "topk"
        if kld not in KLD_MODES:
            raise SystemExit(f"kld must be one of {KLD_MODES}, got {kld!r}")
        self.top_k = top_k
        ref = reference if isinstance(reference, Reference) or reference is None else None
        self.reference = ref
        self.ref_ids = reference if isinstance(reference, np.ndarray) else (ref.topk_ids if ref is not None else None)
        self.kld = kld if reference is not None else None
        if self.kld == "full" and (ref is None or not ref.has_full):
            raise SystemExit("kld=full needs a reference that stores the whole distribution (full_codes); "
                             "this one holds only its top-K: recompute the reference (it is keyed by its format)")
        if self.kld == "topk" and self.ref_ids is None:
            raise SystemExit("kld=topk needs the reference's top-K ids (topk_ids)")
        self.own_topk = reference is None if own_topk is None else own_topk
        if store_full is not None and rows is None:
            raise SystemExit("store_full needs the number of positions the run adds (rows: the sum of the window "
                             "set's window_sizes), to write the stored distribution's header before its data")
        self.store_full = store_full
        self.rows = rows if store_full is not None else None
        self._full_fh: IO[bytes] | None = None
        self._npz: zipfile.ZipFile | None = None  # logprobs.npz being written, when ``rows`` is known
        self.vocab: int | None = None
        self.cursor = 0
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in (
            "target_logprob", "top1", "topk_ids", "topk_logprobs", "tail_logprob", "at_ref_logprobs",
            "at_ref_tail", "kld", "full_lo", "full_step")}

    @classmethod
    def from_request(cls, req: dict[str, Any]) -> Collector:
        """The Collector a runner's request asks for (keys ``reference``, ``kld``, ``top_k``, ``own_topk``,
        ``store_full``; ``ref_topk`` is read as ``reference``)."""
        path = req.get("reference") or req.get("ref_topk")
        store = Path(req["out_dir"]) if req.get("store_full") else None
        if store is not None and not req.get("windows"):
            raise SystemExit("store_full needs the request's windows (the window file) to know how many positions "
                             "the stored distribution holds")
        rows = int(window_sizes(req["windows"]).sum()) if store is not None else None
        return cls(int(req["top_k"]), Reference(path) if path else None, req.get("own_topk"),
                   str(req.get("kld") or "full"), store, rows)

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
        if n == 0:
            return
        if self.vocab is None:
            self.vocab = int(rows.shape[1])
            ref_vocab = self.reference.vocab if self.reference is not None and self.kld == "full" else None
            if ref_vocab is not None and ref_vocab != self.vocab:
                raise SystemExit(f"the engine has {self.vocab} logits per position, the reference {ref_vocab}: "
                                 "not the same vocabulary")
        end = self.cursor + n
        if self.reference is not None and self.reference.n and end > self.reference.n:
            raise SystemExit(f"reference has {self.reference.n} positions, fewer than the window set")
        if self.ref_ids is not None and end > len(self.ref_ids):
            raise SystemExit(f"reference has {len(self.ref_ids)} positions, fewer than the window set")
        if self.rows is not None and end > self.rows:
            raise SystemExit(f"{end} positions added, more than the {self.rows} the window set scores")
        step = block_rows(self.vocab)
        jobs = [(rows[b:b + step], targets[b:b + step], self.cursor + b, normalised) for b in range(0, n, step)]
        outs = pool.map(lambda job: self._block(*job), jobs) if pool is not None and len(jobs) > 1 else \
            [self._block(*job) for job in jobs]
        for out in outs:
            codes = out.pop("full_codes", None)
            if codes is not None:
                self._write_full(codes)
            for key, value in out.items():
                self.parts[key].append(value)
        self.cursor = end

    def _write_full(self, codes: np.ndarray) -> None:
        assert self.store_full is not None
        if self._full_fh is None:
            self._full_fh = self._open_full(int(codes.shape[1]))
        self._full_fh.write(np.ascontiguousarray(codes, dtype="<u2").tobytes())

    def _partial_npz(self) -> Path:
        assert self.store_full is not None
        return self.store_full / f"logprobs.npz.{os.getpid()}.partial"

    def _open_full(self, vocab: int) -> IO[bytes]:
        """Where the codes go: the ``full_codes`` member of the partial npz (its .npy header holds the shape,
        hence the row count first)."""
        assert self.store_full is not None and self.rows is not None
        self._npz = zipfile.ZipFile(self._partial_npz(), "w", zipfile.ZIP_STORED, allowZip64=True)
        member = self._npz.open("full_codes.npy", "w", force_zip64=True)
        np.lib.format.write_array_header_1_0(member, {"descr": "<u2", "fortran_order": False,
                                                      "shape": (self.rows, vocab)})
        return member

    def _block(self, rows: np.ndarray, targets: np.ndarray, pos: int, normalised: bool) -> dict[str, np.ndarray]:
        n = len(targets)
        if normalised:
            # Log-probs keep their precision: rounding normalised float64 log-probs to float32 would break
            # Σ p = 1 by ~1e-7, which a small mass outside the top-K (1 − Σ p_topk) cannot absorb.
            x = np.ascontiguousarray(rows, dtype=np.float64 if rows.dtype == np.float64 else np.float32)
            lse = np.zeros(n)
        else:
            x = np.ascontiguousarray(rows, dtype=np.float32)  # engines' logits are float32: that is the truth
            # exp in float32, accumulated in float64: measured on the demo's logits, the log-probs agree with
            # an all-float64 computation to 2e-16 relative, at half the cost.
            m = x.max(axis=1)
            b = np.subtract(x, m[:, None])
            if self.kld == "full":  # the exact KLD shares b and its Σ e^b with the log-probs (kld_rows' terms)
                assert self.reference is not None
                ref_part = kld_reference_part(b, *self.reference.rows(pos, pos + n))
            np.exp(b, out=b)
            zb = b.sum(axis=1, dtype=np.float64)
            lse = m.astype(np.float64) + np.log(zb)
        out = {"target_logprob": x[np.arange(n), targets].astype(np.float64) - lse,
               "top1": np.argmax(x, axis=1).astype(np.int32)}
        if self.own_topk:
            ids = top_k_rows(x, self.top_k)
            topk_lp = np.take_along_axis(x, ids, axis=1).astype(np.float64) - lse[:, None]
            out["topk_ids"] = ids.astype(np.int32)
            out["topk_logprobs"] = topk_lp.astype(np.float32)
            out["tail_logprob"] = _log_rest(topk_lp)
        if self.store_full is not None:
            out["full_codes"], out["full_lo"], out["full_step"] = encode_rows(x)
        if self.kld == "full" and not normalised:
            out["kld"] = np.maximum(ref_part + np.log(zb), 0.0)
        elif self.kld == "full":
            assert self.reference is not None
            out["kld"] = kld_rows(x, *self.reference.rows(pos, pos + n))
        elif self.kld == "topk":
            assert self.ref_ids is not None
            at_ref = np.take_along_axis(x, self.ref_ids[pos:pos + n], axis=1).astype(np.float64) - lse[:, None]
            out["at_ref_logprobs"] = at_ref.astype(np.float32)
            out["at_ref_tail"] = _log_rest(at_ref)
        return out

    def save(self, out_dir: Path) -> int:
        """Write ``logprobs.npz`` (with the whole stored distribution when ``store_full``); returns the number
        of positions."""
        # Any: np.savez's stub types **kwds against its allow_pickle: bool too; the keys are the fixed names above.
        arrays: dict[str, Any] = {k: np.concatenate(v) for k, v in self.parts.items() if v}
        if self.store_full is not None:
            return self._finish_npz(out_dir, arrays)
        with atomic_path(out_dir / "logprobs.npz") as tmp, tmp.open("wb") as fh:  # a file object: no .npz added
            np.savez(fh, **arrays)
        return self.cursor

    def _finish_npz(self, out_dir: Path, arrays: dict[str, np.ndarray]) -> int:
        """Close the streamed ``full_codes`` member, add the other arrays, and move the npz into place."""
        if self._npz is None:  # no row was added
            self._full_fh = self._open_full(0)
        assert self._npz is not None and self._full_fh is not None
        self._full_fh.close()
        if self.cursor != self.rows:
            self._npz.close()
            self._partial_npz().unlink(missing_ok=True)
            raise SystemExit(f"{self.cursor} positions added, the window set scores {self.rows}: the stored "
                             "distribution would not match its header")
        for key, value in arrays.items():
            with self._npz.open(f"{key}.npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, np.asanyarray(value), allow_pickle=False)
        self._npz.close()
        os.replace(self._partial_npz(), out_dir / "logprobs.npz")
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
