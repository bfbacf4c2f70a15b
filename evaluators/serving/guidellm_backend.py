"""GuideLLM's OpenAI HTTP backend, recording what its report leaves out. Runs only in the ``guidellm`` env.

GuideLLM 0.8.1 keeps, per request, the send time (``request_start``), the first and the last token's arrival
(``first_token_iteration``, ``last_token_iteration``) and a count of streamed chunks, but not the arrival
time of each chunk, so vLLM's ITL (every gap between chunks) cannot be computed from its report. And where
the server sends no ``usage``, its report's output count silently becomes the *requested* count (its
``compile_stats`` merges the request's ``max_tokens`` under the response's missing value).

:class:`RecordingBackend` is GuideLLM's own ``OpenAIHTTPBackend`` with one change: the request handler of
every request is wrapped so that, for every stream line that GuideLLM counts as content, the arrival time
(``time.time()``, GuideLLM's clock, taken just before the line is parsed) is appended to a list; the list,
the server's raw ``usage`` (``None`` when it sent none) and the request's own deadline go into the response's
``response_metrics["quantyard"]``, which GuideLLM copies into its JSON report unchanged. It also enforces a
per-request deadline (``QUANTYARD_REQUEST_TIMEOUT_S``): a line arriving after it fails the request with
:class:`TimeoutError`; GuideLLM's read timeout (the backend's ``timeout``) covers a server that sends nothing.

The runner (``evaluators.serving.guidellm_runner``) installs it under GuideLLM's ``openai_http`` name, so the
report still says ``openai_http``.

:func:`install` also mends a race in GuideLLM 0.8.1's Poisson schedule (``AsyncPoissonStrategy``): its
``init_processes_start`` sets the shared start time, which releases the waiting workers, and only then sets
the shared arrival offset from its initial ``-1.0``. A worker that wakes in between schedules from -1 s
(Unix time), so every arrival of the level is long past and the whole level goes out at once: seen in CI as
16 requests in 0.03 s at 1.5/s, with ``targeted_start`` near 0, which ``load.check_paced`` rejected. The
mended method sets the offset first, then the start time.

GuideLLM pickles the backend into spawned worker processes, which import this module by name (hence a module
of its own, not the runner's ``__main__``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from guidellm.backends.backend import Backend
from guidellm.backends.openai.http import OpenAIHTTPBackend

#: Environment variable holding the per-request deadline in seconds (set by the runner).
TIMEOUT_ENV = "QUANTYARD_REQUEST_TIMEOUT_S"
KEY = "quantyard"


class _Recorder:
    """Wraps one request handler: records content-line arrival times and enforces the deadline."""

    def __init__(self, handler: Any, timeout_s: float | None) -> None:
        self.handler = handler
        self.token_times: list[float] = []
        self.deadline = time.time() + timeout_s if timeout_s else None
        self.timeout_s = timeout_s
        self._add = handler.add_streaming_line
        self._compile = handler.compile_streaming
        handler.add_streaming_line = self.add_streaming_line
        handler.compile_streaming = self.compile_streaming

    def add_streaming_line(self, line: str) -> int | None:
        now = time.time()
        if self.deadline is not None and now > self.deadline:
            raise TimeoutError(f"request exceeded its {self.timeout_s:g} s timeout")
        iterations = self._add(line)
        if iterations is not None and iterations > 0:
            self.token_times.append(now)
        return iterations

    def compile_streaming(self, request: Any, arguments: Any) -> Any:
        response = self._compile(request, arguments)
        usage = getattr(self.handler, "streaming_usage", None)
        extra = {KEY: {"token_times": list(self.token_times), "usage": usage}}
        response.response_metrics = {**(response.response_metrics or {}), **extra}
        return response


class RecordingBackend(OpenAIHTTPBackend):
    """``OpenAIHTTPBackend`` that records every content chunk's arrival time and the raw usage."""

    async def _prepare_resolve_request(self, request: Any, history: Any = None) -> tuple[Any, Any, Any]:
        handler, arguments, kwargs = await super()._prepare_resolve_request(request, history)
        timeout = os.environ.get(TIMEOUT_ENV)
        _Recorder(handler, float(timeout) if timeout else None)
        return handler, arguments, kwargs


def poisson_start_offset_first(strategy: Any, start_time: float) -> None:
    """``AsyncPoissonStrategy.init_processes_start`` with its two writes in the safe order: the arrival offset,
    then the start time that releases the workers (see the module docstring)."""
    from guidellm.scheduler.strategies import ThroughputStrategy

    if strategy._offset is None:
        raise RuntimeError("AsyncPoissonStrategy._offset is None: init_processes_timings was not called")
    with strategy._offset.get_lock():
        strategy._offset.value = start_time
    ThroughputStrategy.init_processes_start(strategy, start_time)


def install() -> None:
    """Make GuideLLM's ``openai_http`` backend kind create :class:`RecordingBackend`, and order the Poisson
    schedule's start (:func:`poisson_start_offset_first`)."""
    from guidellm.scheduler.strategies import AsyncPoissonStrategy

    AsyncPoissonStrategy.init_processes_start = poisson_start_offset_first
    registry = Backend.registry
    if registry is None or "openai_http" not in registry:
        raise RuntimeError("guidellm has no 'openai_http' backend to replace (a changed guidellm version?)")
    registry["openai_http"] = RecordingBackend
