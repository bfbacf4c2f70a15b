"""What a serving result shows, said the same way wherever it is shown: the model page's serving charts and
memory column, the compare page, the model card, ``quantyard show``, the JSON API, ``validate``'s serving
check and ``quantyard recommend``.

A serving result (``EvalResult(kind="serving")``, :mod:`pipeline.serving`) is never a quality or a speed
result: :func:`pipeline.shown.pick` ignores it, and it has its own figures here. :func:`serving_summaries`
gives, per engine, the newest ok serving result of a version as a :class:`ServingSummary`: its load levels
without the raw per-request log (:class:`LevelPoint`), the memory it measured (:class:`MemorySummary`) and the
marks its numbers need: a CPU-scaled load shape (``¶``, :data:`pipeline.shown.CPU_SCALED`) and a vLLM server
whose 4-bit kernel Quantyard replaced by a dense matmul (``§``, :data:`pipeline.shown.DENSE_KERNEL`).

Everything here is read from a measurement; nothing is estimated. A level that did not run is absent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.serving import LevelStats, MemoryInfo, ServingMetrics
from pipeline.shown import CPU_SCALED, DENSE_KERNEL, ROLES, WNA16_DEQUANTIZED, ResultLike, dense_kernel, role_of

#: ``LoadProfile.name`` of a load shape scaled down for a CPU (smaller prompts, outputs or user counts).
CPU_SCALED_PROFILE = "cpu-scaled"


class LevelPoint(BaseModel):
    """One closed-loop load level of a serving result, as tables and charts show it (milliseconds, tokens/s)."""

    model_config = ConfigDict(frozen=True)

    concurrency: int
    requests: int
    completed: int
    failed: int
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    e2el_p99_ms: float | None = None
    output_throughput: float | None = None  # output tokens / s over the level's wall time
    request_throughput: float | None = None

    def value(self, key: str) -> float | None:
        """A figure by name (``ttft_p99_ms``, ``output_throughput``...); None when not measured."""
        v = getattr(self, key, None)
        return float(v) if isinstance(v, int | float) else None


class MemorySummary(BaseModel):
    """The memory a serving result measured: ``peak_bytes`` is the device's peak on a GPU, else the peak
    resident memory (RSS) of the server's process tree, at ``context`` tokens per request with ``users``
    concurrent users (the heaviest level measured)."""

    model_config = ConfigDict(frozen=True)

    peak_bytes: int | None
    source: Literal["device", "rss"] | None  # device: GPU memory; rss: the server's resident memory on CPU
    context: int | None
    users: int | None
    weights_bytes: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None

    @property
    def text(self) -> str:
        """``fits in 1.23 GB at context 8,192 with 64 users`` (decimal GB), saying what was not recorded."""
        if self.peak_bytes is None:
            return "peak memory not measured"
        ctx = f"context {self.context:,}" if self.context else "a context not recorded"
        users = f"{self.users} user{'s' if self.users != 1 else ''}" if self.users else "users not recorded"
        return f"fits in {gigabytes(self.peak_bytes)} at {ctx} with {users}"

    @property
    def what(self) -> str:
        """What the peak is: ``measured peak device memory (GPU)`` or ``measured peak RSS of the server (CPU)``."""
        return {"device": "measured peak device memory (GPU)",
                "rss": "measured peak resident memory (RSS) of the server's processes (CPU)"}.get(
                    self.source or "", "not measured")


class ServingSummary(BaseModel):
    """The newest ok serving result of one version on one engine, without its raw per-request log."""

    model_config = ConfigDict(frozen=True)

    variant: str
    ref: str
    format: str
    engine: str
    engine_version: str | None = None
    role: str = "engine"  # pipeline.shown.role_of: engine | stand-in | cross-check | other
    server: str
    server_version: str
    result_id: int | None = None
    created_at: str | None = None
    profile: str  # LoadProfile.name: seed | sweep | cpu-scaled | custom
    profile_note: str | None = None
    profile_tool: str
    prompt_tokens: int
    output_tokens: int
    cpu_scaled: bool = False
    kernel: str | None = None  # the dense-matmul replacement of vLLM's 4-bit kernel, when it served
    hardware: str | None = None
    levels: list[LevelPoint] = Field(default_factory=list)
    memory: MemorySummary
    marks: list[str] = Field(default_factory=list)  # pipeline.shown.mark_of keys

    @property
    def label(self) -> str:
        """``Q4_K_M · llama.cpp``: a chart series or a table row."""
        return f"{self.variant} · {self.engine}"

    @property
    def symbols(self) -> str:
        """The marks' symbols, for a label (``¶§``)."""
        return "".join(s for s, on in ((CPU_SCALED.symbol, self.cpu_scaled), (DENSE_KERNEL.symbol, bool(self.kernel)))
                       if on)

    def level(self, concurrency: int) -> LevelPoint | None:
        return next((lv for lv in self.levels if lv.concurrency == concurrency), None)

    def level_at_least(self, users: int) -> LevelPoint | None:
        """The smallest measured level with at least ``users`` concurrent users, or None."""
        return min((lv for lv in self.levels if lv.concurrency >= users), key=lambda lv: lv.concurrency, default=None)

    @property
    def shape(self) -> str:
        """The load shape in words: ``cpu-scaled profile, 128 prompt / 64 output tokens (guidellm 0.x)``."""
        return (f"{self.profile} profile, {self.prompt_tokens} prompt / {self.output_tokens} output tokens "
                f"({self.profile_tool})")


def gigabytes(n: int | float) -> str:
    """Bytes in decimal gigabytes (GB = 10^9 B), as the registry prints sizes; below 0.1 GB in MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def parse_serving(metrics: Mapping[str, Any]) -> ServingMetrics | None:
    """A stored serving result's metrics as the model, without the per-request logs (which tables never show
    and which are by far its largest part); None when they are not a serving result of this schema."""
    light = dict(metrics)
    if isinstance(light.get("levels"), list):
        light["levels"] = [{k: v for k, v in lv.items() if k != "requests_log"} if isinstance(lv, dict) else lv
                           for lv in light["levels"]]
    try:
        return ServingMetrics.model_validate(light)
    except ValueError:
        return None


def _pct(p: Any, key: str) -> float | None:
    return None if p is None else float(getattr(p, key))


def level_point(lv: LevelStats) -> LevelPoint | None:
    """A closed-loop level as a :class:`LevelPoint` (None for an open-loop, Poisson-rate level)."""
    if lv.mode != "concurrency" or lv.concurrency is None:
        return None
    return LevelPoint(concurrency=lv.concurrency, requests=lv.requests, completed=lv.completed, failed=lv.failed,
                      ttft_p50_ms=_pct(lv.ttft_ms, "median"), ttft_p99_ms=_pct(lv.ttft_ms, "p99"),
                      itl_p50_ms=_pct(lv.itl_ms, "median"), itl_p99_ms=_pct(lv.itl_ms, "p99"),
                      tpot_p50_ms=_pct(lv.tpot_ms, "median"), tpot_p99_ms=_pct(lv.tpot_ms, "p99"),
                      e2el_p99_ms=_pct(lv.e2el_ms, "p99"), output_throughput=lv.output_throughput,
                      request_throughput=lv.request_throughput)


def memory_summary(mem: MemoryInfo, context_per_request: int | None) -> MemorySummary:
    """The measured memory; the context is the one memory was measured at, else the server's per-request one."""
    source: Literal["device", "rss"] | None = "device" if mem.device_peak_bytes else \
        "rss" if mem.rss_peak_bytes else None
    return MemorySummary(peak_bytes=mem.peak_bytes, source=source, context=mem.context or context_per_request,
                         users=mem.concurrency, weights_bytes=mem.weights_bytes, kv_cache_bytes=mem.kv_cache_bytes,
                         kv_cache_tokens=mem.kv_cache_tokens)


def served_kernel(flags: Mapping[str, Any]) -> str | None:
    """The kernel's name when the server ran vLLM's 4-bit linears on Quantyard's dense-matmul replacement:
    ``wna16_kernel_id`` ``dequantized`` (as the evaluator's speed results say it), or a bare ``wna16_kernel``
    ``dequantized`` (the id alone); else None."""
    named = dense_kernel(flags)
    if named is not None:
        return named
    return WNA16_DEQUANTIZED if flags.get("wna16_kernel") == WNA16_DEQUANTIZED else None


def hardware_text(hardware: Mapping[str, Any]) -> str | None:
    """The few hardware facts a reader needs beside a latency: GPU or CPU, threads."""
    keys = ("gpu", "cpu", "cores", "threads")
    parts = [f"{k}={hardware[k]}" for k in keys if hardware.get(k) not in (None, "")]
    return ", ".join(parts) or None


def summarize(variant: str, ref: str, fmt: str, r: Any) -> ServingSummary | None:
    """One stored serving result (``EvalResult`` or ``ResultView``) as a :class:`ServingSummary`, or None
    when its metrics are not a serving result of this schema."""
    m = parse_serving(r.metrics)
    if m is None:
        return None
    kernel = served_kernel(m.server.flags)
    cpu_scaled = m.profile.name == CPU_SCALED_PROFILE
    marks = [k.key for k, on in ((CPU_SCALED, cpu_scaled), (DENSE_KERNEL, bool(kernel))) if on]
    levels = sorted((p for p in (level_point(lv) for lv in m.levels) if p is not None), key=lambda p: p.concurrency)
    return ServingSummary(
        variant=variant, ref=ref, format=fmt, engine=r.engine, engine_version=r.engine_version,
        role=role_of(fmt, r.engine), server=m.server.server, server_version=m.server.version,
        result_id=getattr(r, "id", None), created_at=getattr(r, "created_at", None), profile=m.profile.name,
        profile_note=m.profile.note, profile_tool=m.profile.tool, prompt_tokens=m.profile.prompt_tokens,
        output_tokens=m.profile.output_tokens, cpu_scaled=cpu_scaled, kernel=kernel,
        hardware=hardware_text(r.hardware or {}), levels=levels,
        memory=memory_summary(m.memory, m.server.context_per_request), marks=marks)


def serving_results(results: Iterable[ResultLike]) -> list[ResultLike]:
    """The ok serving results among ``results``, in their order."""
    return [r for r in results if r.kind == "serving" and r.status == "ok"]


def serving_summaries(variant: str, ref: str, fmt: str, results: Sequence[ResultLike]) -> list[ServingSummary]:
    """The newest ok serving result of each engine of one version (``results`` oldest first), the format's
    own engine first (:func:`pipeline.shown.role_of`), as summaries; results that do not parse are left out."""
    newest: dict[str, ResultLike] = {}
    for r in serving_results(results):
        if parse_serving(r.metrics) is not None:
            newest[r.engine] = r
    ordered = sorted(newest.values(), key=lambda r: ROLES.index(role_of(fmt, r.engine)))
    return [s for s in (summarize(variant, ref, fmt, r) for r in ordered) if s is not None]


def profiles_note(summaries: Sequence[ServingSummary]) -> str | None:
    """A note naming the load shapes when ``summaries`` were measured with more than one (their latencies are
    comparable only within one shape), else None."""
    groups: dict[str, list[str]] = {}
    for s in summaries:
        groups.setdefault(s.shape, []).append(s.label)
    if len(groups) < 2:
        return None
    return ("serving figures from " + str(len(groups)) + " different load shapes, comparable only within one — "
            + "; ".join(f"{shape}: {', '.join(labels)}" for shape, labels in groups.items()))


def hardware_note(summaries: Sequence[ServingSummary]) -> str | None:
    """A note naming the machines when ``summaries`` were measured on more than one, else None."""
    groups: dict[str, list[str]] = {}
    for s in summaries:
        groups.setdefault(s.hardware or "hardware not recorded", []).append(s.label)
    if len(groups) < 2:
        return None
    return ("serving figures measured on " + str(len(groups)) + " different machines — "
            + "; ".join(f"{hw}: {', '.join(labels)}" for hw, labels in groups.items()))


__all__ = ["CPU_SCALED_PROFILE", "LevelPoint", "MemorySummary", "ServingSummary", "gigabytes", "hardware_note",
           "level_point", "memory_summary", "parse_serving", "profiles_note", "served_kernel", "serving_results",
           "serving_summaries", "summarize"]
