"""Exact prompt logits from vLLM, for the whole vocabulary, without a Python object per log-prob.

vLLM computes a prompt's logits only to turn them into ``prompt_logprobs``; it returns at most the top-N
of every row, as Python objects. This module captures the whole logits tensor of every prompt position
inside vLLM's own prompt-logprob step and hands it, row block by row block, to the shared
:class:`~evaluators.protocol.Collector`: whatever the vocabulary (262,144 included), the runner scores the
numbers vLLM computed, not an estimate, and never holds more than the rows of the windows in flight.

How. The runner asks for ``prompt_logprobs=0`` (the actual token only), so vLLM still computes the prompt
logits, and installs three hooks on the model runner of the in-process engine (the engine core must run
in the runner's process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; :func:`model_runner` checks it):

* ``execute_model``: the scheduler's new requests name each internal request id with its prompt token
  ids; a prompt is matched to the next expected window with those ids (identical windows are
  interchangeable).
* the prompt-logprob step: V1's ``GPUModelRunner._get_prompt_logprobs_dict(hidden_states,
  num_scheduled_tokens)`` (also vLLM-CPU's model runner) or V2's
  ``PromptLogprobsWorker.compute_prompt_logprobs(logits_fn, hidden_states, input_batch, ...)`` (vLLM's CUDA build:
  a GPU path, written against vllm 0.33.0's source; whether it has run on a GPU is recorded in
  ``pipeline/status.py``). Before it
  runs, the hook records which rows of this step's hidden states belong to which request and at which
  prompt position (the same state the step itself reads); while it runs, every ``compute_logits`` call
  (V1: ``model.compute_logits``, swapped on the instance for the call; V2: the ``logits_fn`` argument) is
  observed: its input is a row slice of the step's hidden states, so its output rows map to (request,
  position).
* chunked prefill splits a prompt across steps; rows arrive in position order, and a prompt recomputed
  after preemption repeats rows, which are skipped.

Every pinned internal is checked when the hooks are installed (:class:`CaptureUnsupported`, a
``SystemExit`` saying what was expected) and every window must arrive whole (:meth:`WindowFeeder.finish`).
The runner also compares, at every scored position, the log-prob of the actual token computed from the
captured row with the one vLLM itself returned (``capture_check_max_abs``): a row mapped to the wrong
window or position would differ by nats.
"""

from __future__ import annotations

import inspect
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evaluators.protocol import Collector

V1_STEP = "GPUModelRunner._get_prompt_logprobs_dict"
V2_STEP = "PromptLogprobsWorker.compute_prompt_logprobs"
V1_PARAMS = ("hidden_states", "num_scheduled_tokens")
V2_PARAMS = ("logits_fn", "hidden_states", "input_batch", "all_token_ids", "num_computed_tokens", "prompt_lens")


class CaptureUnsupported(SystemExit):
    """This vLLM's model runner is not the one the capture was written against."""


# --- which window's rows: the consumer side (plain numpy, no vLLM) --------------------------------------


@dataclass
class _Window:
    index: int
    next_pos: int = 0  # the next prompt position whose row is expected
    buffer: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


class WindowFeeder:
    """Puts the captured rows of windows ``first .. first+count-1`` into ``col`` in window order.

    Rows of prompt position ``p`` predict ``ids[k, p + 1]``; only positions ``score_start[k] - 1 ..
    window - 2`` are scored. Rows of the window next in order go straight to the Collector; rows of a
    later window wait (copied) until the windows before it are complete.
    """

    def __init__(self, col: Collector, ids: np.ndarray, starts: np.ndarray, first: int, count: int,
                 pool: Executor | None = None) -> None:
        self.col, self.ids, self.starts, self.pool = col, ids, starts, pool
        self.windows = {k: _Window(k) for k in range(first, first + count)}
        self.current = first
        self.end = first + count
        self.rows_seen = 0
        self.buffered_bytes = 0
        self.peak_buffered_bytes = 0

    @property
    def last_pos(self) -> int:
        """Rows of positions ``0 .. last_pos - 1`` exist per window (the last token predicts nothing scored)."""
        return int(self.ids.shape[1]) - 1

    def rows(self, k: int, pos0: int, logits: np.ndarray) -> None:
        """``logits`` [n, V]: rows of window ``k`` at prompt positions ``pos0 .. pos0+n-1``.

        Raises:
            SystemExit: rows skip a position, or ``k`` is not a window of this feeder.
        """
        w = self.windows.get(k)
        if w is None:
            raise SystemExit(f"captured rows for window {k}, not one of {self.current}..{self.end - 1}")
        if pos0 > w.next_pos:
            raise SystemExit(f"window {k}: captured rows start at position {pos0}, expected {w.next_pos}: "
                             "vLLM skipped prompt positions")
        logits = logits[w.next_pos - pos0:min(len(logits), self.last_pos - pos0)]  # repeats and the last row go
        pos0 = w.next_pos
        if not len(logits):
            return
        w.next_pos += len(logits)
        self.rows_seen += len(logits)
        skip = max(0, int(self.starts[k]) - 1 - pos0)  # context rows: not scored
        keep = logits[skip:]
        if len(keep):
            first = pos0 + skip + 1
            targets = self.ids[k, first:first + len(keep)]
            if k == self.current:
                self.col.add_rows(keep, targets, self.pool)
            else:
                w.buffer.append((np.array(keep, dtype=np.float32), targets))
                self.buffered_bytes += w.buffer[-1][0].nbytes
                self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)
        self._advance()

    def _advance(self) -> None:
        while self.current < self.end and self.windows[self.current].next_pos >= self.last_pos:
            self.current += 1
            if self.current < self.end:
                w = self.windows[self.current]
                for rows, targets in w.buffer:
                    self.col.add_rows(rows, targets, self.pool)
                    self.buffered_bytes -= rows.nbytes
                w.buffer.clear()

    def finish(self) -> None:
        """Raises SystemExit unless every window arrived whole."""
        missing = {k: w.next_pos for k, w in self.windows.items() if w.next_pos < self.last_pos}
        if missing:
            some = ", ".join(f"window {k}: {n} of {self.last_pos} rows" for k, n in list(missing.items())[:5])
            raise SystemExit(f"vLLM's prompt logits were not captured for {len(missing)} window(s) ({some}); "
                             "the model runner did not call the hooked prompt-logprob step as expected")


# --- the vLLM side: hooks on the in-process model runner --------------------------------------------------

_LOCATED: dict[int, Any] = {}


def _locate(worker: Any) -> tuple[int, int]:
    """Runs inside vLLM's worker (through ``collective_rpc``): keeps its model runner where this module
    can find it, and says in which process it runs."""
    runner = worker.model_runner
    _LOCATED[id(runner)] = runner
    return os.getpid(), id(runner)


def model_runner(llm: Any) -> Any:
    """The model runner of ``llm``'s engine, which must run in this process.

    Raises:
        CaptureUnsupported: the engine core runs in another process, or several workers run.
    """
    located = llm.collective_rpc(_locate)
    if len(located) != 1 or located[0][0] != os.getpid() or located[0][1] not in _LOCATED:
        raise CaptureUnsupported(
            "capturing vLLM's prompt logits needs one worker in this process (got "
            f"{[pid for pid, _ in located]}, this process is {os.getpid()}): run with "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 (the vLLM evaluator sets it) and one worker (tensor_parallel_size=1)")
    return _LOCATED[located[0][1]]


@dataclass
class Segment:
    """The rows of one request in one step's hidden states."""

    req_id: str
    row0: int  # first row of the request in this step's hidden states
    rows: int
    pos0: int  # prompt position of row0
    prompt_len: int


@contextmanager
def _expected(step: str, what: str) -> Iterator[None]:
    """An AttributeError while reading the model runner's state is a changed vLLM: say what was expected."""
    try:
        yield
    except AttributeError as exc:
        raise CaptureUnsupported(f"vLLM's {step} no longer has the state the capture reads ({what}): {exc}; "
                                 "evaluators/vllm/capture.py needs updating for this vLLM version") from exc


def _params(fn: Any) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def step_kind(runner: Any) -> str:
    """``V1_STEP`` or ``V2_STEP``: which prompt-logprob step this model runner has.

    Raises:
        CaptureUnsupported: neither, or not with the expected parameters and state.
    """
    worker = getattr(runner, "prompt_logprobs_worker", None)
    found: list[str] = []
    if worker is not None and callable(getattr(worker, "compute_prompt_logprobs", None)):
        params = _params(worker.compute_prompt_logprobs)
        if params[:len(V2_PARAMS)] == V2_PARAMS:
            return V2_STEP
        found.append(f"{V2_STEP}{params}")
    step = getattr(runner, "_get_prompt_logprobs_dict", None)
    if callable(step):
        params = _params(step)
        state = all(hasattr(runner, a) for a in ("num_prompt_logprobs", "requests", "input_batch", "query_start_loc"))
        if params == V1_PARAMS and state and callable(getattr(runner.model, "compute_logits", None)):
            return V1_STEP
        found.append(f"{V1_STEP}{params} (runner state present: {state})")
    raise CaptureUnsupported(
        f"vLLM's model runner {type(runner).__name__} has no prompt-logprob step the capture knows: expected "
        f"{V1_STEP}{V1_PARAMS} with model.compute_logits, or {V2_STEP}{V2_PARAMS}; found "
        f"{'; '.join(found) or 'neither'}. evaluators/vllm/capture.py needs updating for this vLLM version")


class PromptLogitCapture:
    """The hooks on one model runner; :meth:`expect` names the windows of the next ``generate`` call."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.kind = step_kind(runner)
        if not callable(getattr(runner, "execute_model", None)):
            raise CaptureUnsupported(f"vLLM's model runner {type(runner).__name__} has no execute_model")
        self.pending: dict[tuple[int, ...], deque[int]] = {}
        self.req_window: dict[str, int] = {}
        self.sink: Callable[[int, int, np.ndarray], None] | None = None
        self.calls = 0
        self.logits_dtype: str | None = None
        self._undo: list[Callable[[], None]] = []

    def expect(self, windows: dict[int, np.ndarray], sink: Callable[[int, int, np.ndarray], None]) -> None:
        """Rows of the prompts ``windows`` (window index → token ids) go to ``sink(k, pos0, logits)``."""
        self.pending, self.req_window, self.sink = {}, {}, sink
        for k, ids in windows.items():
            self.pending.setdefault(tuple(int(t) for t in ids), deque()).append(k)

    # -- install / remove

    def install(self) -> None:
        runner = self.runner
        self._patch(runner, "execute_model", self._wrap_execute(runner.execute_model))
        if self.kind == V1_STEP:
            self._patch(runner, "_get_prompt_logprobs_dict", self._wrap_v1(runner._get_prompt_logprobs_dict))
        else:
            worker = runner.prompt_logprobs_worker
            self._patch(worker, "compute_prompt_logprobs", self._wrap_v2(worker.compute_prompt_logprobs))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _patch(self, obj: Any, name: str, fn: Callable[..., Any]) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, fn)
        self._undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    # -- hooks

    def _wrap_execute(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model(*args: Any, **kwargs: Any) -> Any:
            out = args[0] if args else kwargs.get("scheduler_output")
            for new in getattr(out, "scheduled_new_reqs", None) or ():
                queue = self.pending.get(tuple(new.prompt_token_ids or ()))
                if queue and new.req_id not in self.req_window:
                    self.req_window[new.req_id] = queue.popleft()
            return original(*args, **kwargs)
        return execute_model

    def _wrap_v1(self, original: Callable[..., Any]) -> Callable[..., Any]:
        runner = self.runner

        def step(hidden_states: Any, num_scheduled_tokens: dict[str, int]) -> Any:
            segments = []
            with _expected(V1_STEP, "requests[id].num_computed_tokens/prompt_token_ids, query_start_loc.np, "
                                    "input_batch.req_id_to_index"):
                for req_id in list(runner.num_prompt_logprobs):
                    n = num_scheduled_tokens.get(req_id)
                    if n is None or req_id not in self.req_window:
                        continue
                    req = runner.requests[req_id]
                    row0 = int(runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]])
                    segments.append(Segment(req_id, row0, int(n), int(req.num_computed_tokens),
                                            len(req.prompt_token_ids)))
            model = runner.model
            compute = model.compute_logits
            had = "compute_logits" in vars(model)

            def compute_logits(h: Any) -> Any:
                out = compute(h)
                self._route(hidden_states, h, out, segments)
                return out

            model.compute_logits = compute_logits
            try:
                return original(hidden_states, num_scheduled_tokens)
            finally:
                if had:
                    model.compute_logits = compute
                else:
                    del model.compute_logits
        return step

    def _wrap_v2(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(logits_fn: Callable[[Any], Any], hidden_states: Any, input_batch: Any, *args: Any,
                 **kwargs: Any) -> Any:
            prompt_lens = kwargs["prompt_lens"] if "prompt_lens" in kwargs else args[2]
            segments = []
            with _expected(V2_STEP, "input_batch.req_ids/query_start_loc_np/num_scheduled_tokens/"
                                    "num_computed_prefill_tokens_np/idx_mapping_np"):
                for i, req_id in enumerate(input_batch.req_ids):
                    if req_id not in self.req_window:
                        continue
                    segments.append(Segment(
                        req_id, int(input_batch.query_start_loc_np[i]), int(input_batch.num_scheduled_tokens[i]),
                        int(input_batch.num_computed_prefill_tokens_np[i]),
                        int(prompt_lens[input_batch.idx_mapping_np[i]])))

            def capture(h: Any) -> Any:
                out = logits_fn(h)
                self._route(hidden_states, h, out, segments)
                return out

            return original(capture, hidden_states, input_batch, *args, **kwargs)
        return step

    def _route(self, hidden: Any, h: Any, logits: Any, segments: list[Segment]) -> None:
        if logits is None:  # another tensor-parallel rank's share: not on this one
            return
        self.calls += 1
        self.logits_dtype = str(logits.dtype).removeprefix("torch.")
        assert self.sink is not None
        route(hidden, h, logits, segments, self.req_window, self.sink)


def route(hidden: Any, h: Any, logits: Any, segments: list[Segment], req_window: dict[str, int],
          sink: Callable[[int, int, np.ndarray], None]) -> None:
    """Hand the rows of ``logits`` (computed from ``h``, a row slice of the step's ``hidden`` states) that
    are prompt rows of a request in ``segments`` to ``sink(window, first position, float32 rows)``.

    Raises:
        CaptureUnsupported: ``h`` is not a row slice of ``hidden``.
    """
    row_bytes = hidden.stride(0) * hidden.element_size()
    delta = h.data_ptr() - hidden.data_ptr()
    if (h.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr() or h.stride(0) != hidden.stride(0)
            or delta < 0 or delta % row_bytes):
        raise CaptureUnsupported("vLLM computed prompt logits from a tensor that is not a row slice of the "
                                 "step's hidden states: the capture cannot tell whose rows they are")
    offset = delta // row_bytes
    n = int(logits.shape[0])
    host: np.ndarray | None = None
    for s in segments:
        a, b = max(s.row0, offset), min(s.row0 + s.rows, offset + n)
        pos0 = s.pos0 + a - s.row0
        b = min(b, a + s.prompt_len - 1 - pos0)  # a prompt's last row predicts a generated token
        if b <= a:
            continue
        if host is None:
            host = logits.detach().float().cpu().numpy()
        sink(req_window[s.req_id], pos0, host[a - offset:b - offset])


@contextmanager
def capturing(llm: Any) -> Iterator[PromptLogitCapture]:
    """Hooks installed on ``llm``'s model runner for the duration (removed after: the speed pass that
    follows runs on vLLM's own code)."""
    cap = PromptLogitCapture(model_runner(llm))
    cap.install()
    try:
        yield cap
    finally:
        cap.remove()
