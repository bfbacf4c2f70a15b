"""``quantyard recommend``: which variants of a model to serve for a memory budget, a context, a number of users
and optional latency and quality limits, from the registry's MEASURED results only.

For the latest version of every variant and each engine that served it (:func:`pipeline.serving_summary.
serving_summaries`), a candidate survives when:

1. its newest serving result covers the ask: memory was measured at a context ≥ the asked one and with at least
   the asked users, and a closed-loop level ran with at least that many users (the smallest such level gives
   the latencies and the throughput: a measurement, at that level, not an interpolation);
2. its measured peak memory (device on a GPU, RSS on a CPU) fits the budget;
3. that level had no failed request, and its p99 TTFT / ITL meet the asked limits (a missing figure fails);
4. with ``max_kld``: the version's quality result (:func:`pipeline.shown.pick`) has an exact full-vocabulary KLD
   within the limit; a top-K lower bound or an estimate is not accepted, and says so.

Survivors are ranked by non-dominated sorting on (exact KLD ↓, peak memory ↓, output tok/s ↑): rank 1 is the
Pareto front; within a rank, by KLD, then memory. A survivor without an exact KLD cannot be placed and is listed
unranked. Every other candidate is listed with every reason it was excluded.

Estimates: a candidate measured at a smaller context than asked is excluded. Where the engine reported its KV
cache (bytes for a number of tokens), the reason carries an ESTIMATE of the peak at the asked context (the
measured peak plus the KV cache scaled linearly to context × users tokens): labelled as such, and ranked only
with ``allow_estimates`` (then flagged ``estimate`` in its row). Latencies are never estimated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.results import kld_of
from pipeline.serving_summary import LevelPoint, ServingSummary, gigabytes, serving_summaries
from pipeline.shown import pick
from registry.views import VersionView


class RecommendRequest(BaseModel):
    """What the user asks for. Bytes are bytes (``--max-memory 8G`` is 8 × 10^9)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    max_memory_bytes: int = Field(gt=0)
    context: int = Field(gt=0)
    users: int = Field(gt=0)
    max_kld: float | None = Field(default=None, ge=0)
    p99_ttft_ms: float | None = Field(default=None, gt=0)
    p99_itl_ms: float | None = Field(default=None, gt=0)
    allow_estimates: bool = False


class Choice(BaseModel):
    """One candidate (a variant's latest version on one engine) with its figures and its verdict."""

    variant: str
    ref: str
    format: str
    engine: str | None = None
    rank: int | None = None  # 1 = on the Pareto front; None: excluded or unranked
    kld: float | None = None  # exact full-vocabulary KLD only
    kld_kind: str | None = None  # exact | lower_bound | estimate | missing
    peak_bytes: int | None = None
    peak_is_estimate: bool = False
    memory_source: str | None = None  # device | rss
    measured_context: int | None = None
    measured_users: int | None = None
    level_users: int | None = None  # the load level the latencies and throughput come from
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None
    output_tok_s: float | None = None
    profile: str | None = None
    marks: list[str] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)  # why excluded (empty for a survivor)
    notes: list[str] = Field(default_factory=list)  # estimates and labels

    @property
    def name(self) -> str:
        return f"{self.variant} on {self.engine}" if self.engine else self.variant


class Recommendation(BaseModel):
    request: RecommendRequest
    ranked: list[Choice] = Field(default_factory=list)
    unranked: list[Choice] = Field(default_factory=list)  # fit every limit, but no exact KLD to rank by
    excluded: list[Choice] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def ms(x: float) -> str:
    """A latency for a reason line: ``812 ms`` or ``1.4 s``."""
    return f"{x / 1000:.3g} s" if x >= 1000 else f"{x:.3g} ms"


@dataclass
class _Judge:
    """The checks of one candidate, accumulating reasons and notes."""

    req: RecommendRequest
    choice: Choice
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def coverage(self, s: ServingSummary) -> LevelPoint | None:
        mem, req = s.memory, self.req
        if mem.context is None:
            self.reasons.append("the serving result does not record the context it was measured at")
        elif mem.context < req.context:
            self.context_shortfall(s)
        if mem.users is None:
            self.reasons.append("the serving result does not record how many users its memory was measured with")
        elif mem.users < req.users:
            self.reasons.append(f"memory measured with {mem.users} users < {req.users}: the measurement does not "
                                "cover the ask")
        level = s.level_at_least(req.users)
        if level is None:
            ran = ", ".join(str(lv.concurrency) for lv in s.levels) or "none"
            self.reasons.append(f"no load level with ≥ {req.users} users was measured (levels: {ran}): the "
                                "measurement does not cover the ask")
        return level

    def context_shortfall(self, s: ServingSummary) -> None:
        mem, req = s.memory, self.req
        text = f"measured at context {mem.context:,} < {req.context:,}"
        found = kv_estimate(s, req)
        if found is None:
            self.reasons.append(text + " (the engine reported no KV cache size to estimate from)")
            return
        estimate, how = found
        label = (f"ESTIMATE, not a measurement: about {gigabytes(estimate)} at context {req.context:,} with "
                 f"{req.users} users ({how})")
        if self.req.allow_estimates:
            self.notes.append(f"{text}; memory is an {label}")
            self.choice.peak_bytes, self.choice.peak_is_estimate = estimate, True
        else:
            self.reasons.append(f"{text}; {label}; pass --allow-estimates to rank it on the estimate")

    def memory(self) -> None:
        peak = self.choice.peak_bytes
        budget = self.req.max_memory_bytes
        if peak is None:
            self.reasons.append("no measured peak memory")
        elif peak > budget:
            what = "estimated peak" if self.choice.peak_is_estimate else "peak"
            self.reasons.append(f"{what} {gigabytes(peak)} > {gigabytes(budget)}")

    def level(self, lv: LevelPoint) -> None:
        if lv.failed:
            self.reasons.append(f"{lv.failed} of {lv.requests} requests failed at {lv.concurrency} users")
        for key, limit, label in (("ttft_p99_ms", self.req.p99_ttft_ms, "p99 TTFT"),
                                  ("itl_p99_ms", self.req.p99_itl_ms, "p99 ITL")):
            if limit is None:
                continue
            value = lv.value(key)
            if value is None:
                self.reasons.append(f"{label} at {lv.concurrency} users not measured (needed by the {ms(limit)} "
                                    "limit)")
            elif value > limit:
                self.reasons.append(f"{label} {ms(value)} > {ms(limit)} at {lv.concurrency} users")

    def quality(self, view: VersionView) -> None:
        q = pick(view.format, view.results).quality
        k = kld_of(q.metrics) if q is not None else None
        self.choice.kld_kind = k.kind if k is not None else "missing"
        self.choice.kld = k.value if k is not None and k.exact else None
        if self.req.max_kld is None:
            return
        if k is None or k.value is None:
            self.reasons.append("no KLD measured (no quality result)")
        elif not k.exact:
            what = "a top-K lower bound" if k.kind == "lower_bound" else "an estimate"
            self.reasons.append(f"KLD only {what} ({k.value:.4g}): --max-kld needs the exact full-vocabulary KLD")
        elif k.value > self.req.max_kld:
            self.reasons.append(f"KLD {k.value:.4g} > {self.req.max_kld:.4g}")


def kv_estimate(s: ServingSummary, req: RecommendRequest) -> tuple[int, str] | None:
    """An ESTIMATE of the peak at ``req.context`` × ``req.users`` tokens, and how it was made: the measured peak
    plus the engine's reported KV cache scaled linearly from the tokens it was sized for (the measured peak alone
    when that KV cache already holds them). None without the figures it needs."""
    mem = s.memory
    if not (mem.peak_bytes and mem.kv_cache_bytes and mem.kv_cache_tokens):
        return None
    asked = req.context * req.users
    if asked <= mem.kv_cache_tokens:
        return mem.peak_bytes, (f"the measured peak: the KV cache it was measured with, {mem.kv_cache_tokens:,} "
                                f"tokens, already holds {req.context:,} × {req.users} = {asked:,}, if the server is "
                                "started with that context per request")
    extra = mem.kv_cache_bytes * (asked / mem.kv_cache_tokens - 1.0)
    return int(mem.peak_bytes + extra), (
        f"the measured peak {gigabytes(mem.peak_bytes)} plus the engine's reported KV cache, "
        f"{gigabytes(mem.kv_cache_bytes)} for {mem.kv_cache_tokens:,} tokens, scaled linearly to {asked:,} tokens")


def judge(view: VersionView, s: ServingSummary, req: RecommendRequest) -> Choice:
    """One candidate's figures and every reason it does not fit (none: it fits)."""
    mem = s.memory
    choice = Choice(variant=view.variant, ref=view.ref, format=view.format, engine=s.engine,
                    peak_bytes=mem.peak_bytes, memory_source=mem.source, measured_context=mem.context,
                    measured_users=mem.users, profile=s.profile, marks=list(s.marks))
    j = _Judge(req, choice)
    level = j.coverage(s)
    j.memory()
    if level is not None:
        choice.level_users, choice.output_tok_s = level.concurrency, level.output_throughput
        choice.p99_ttft_ms, choice.p99_itl_ms = level.ttft_p99_ms, level.itl_p99_ms
        if level.concurrency != req.users:
            j.notes.append(f"latencies and throughput measured at {level.concurrency} users, the smallest measured "
                           f"level ≥ {req.users}")
        j.level(level)
    j.quality(view)
    if s.cpu_scaled:
        j.notes.append(f"CPU-scaled load shape: {s.profile_note or s.shape}")
    if s.kernel:
        j.notes.append(f"served with a dense-matmul stand-in for vLLM's 4-bit kernel ({s.kernel})")
    choice.reasons, choice.notes = j.reasons, j.notes
    return choice


def _dominates(a: Choice, b: Choice) -> bool:
    ka, kb = (a.kld, a.peak_bytes, -(a.output_tok_s or 0.0)), (b.kld, b.peak_bytes, -(b.output_tok_s or 0.0))
    return all(x <= y for x, y in zip(ka, kb, strict=True)) and ka != kb  # type: ignore[operator]


def pareto_ranks(choices: Sequence[Choice]) -> list[Choice]:
    """``choices`` (each with an exact KLD, a peak and a throughput) with ``rank`` set by non-dominated sorting,
    best first: rank 1 is the Pareto front on (KLD ↓, peak memory ↓, output tok/s ↑)."""
    left, out, rank = list(choices), [], 1
    while left:
        front = [c for c in left if not any(_dominates(o, c) for o in left if o is not c)]
        for c in sorted(front, key=lambda c: (c.kld, c.peak_bytes, -(c.output_tok_s or 0.0))):
            out.append(c.model_copy(update={"rank": rank}))
        left = [c for c in left if all(c is not f for f in front)]
        rank += 1
    return out


def recommend(views: Sequence[VersionView], req: RecommendRequest) -> Recommendation:
    """Judge every (variant, engine) of ``views`` (the latest version of each variant) against ``req``."""
    out = Recommendation(request=req)
    survivors: list[Choice] = []
    for view in views:
        summaries = serving_summaries(view.variant, view.ref, view.format, view.results)
        if not summaries:
            out.excluded.append(Choice(variant=view.variant, ref=view.ref, format=view.format,
                                       reasons=["no serving result"]))
            continue
        for s in summaries:
            choice = judge(view, s, req)
            (out.excluded if choice.reasons else survivors).append(choice)
    rankable = [c for c in survivors if c.kld is not None and c.peak_bytes is not None and c.output_tok_s is not None]
    out.ranked = pareto_ranks(rankable)
    out.unranked = [c.model_copy(update={"notes": [*c.notes, _unranked_reason(c)]})
                    for c in survivors if all(c is not r for r in rankable)]
    out.notes = _notes(out)
    return out


def _unranked_reason(c: Choice) -> str:
    if c.kld is None:
        kind = {"lower_bound": "only a top-K lower bound", "estimate": "only an estimate"}.get(c.kld_kind or "",
                                                                                            "none measured")
        return f"not ranked: no exact KLD ({kind})"
    return "not ranked: no output throughput measured at that level"


def _notes(out: Recommendation) -> list[str]:
    notes = ["figures are measurements from the registry; a figure marked ESTIMATE is not"]
    shapes = {c.profile for c in [*out.ranked, *out.unranked] if c.profile}
    if len(shapes) > 1:
        notes.append(f"the candidates were measured with different load profiles ({', '.join(sorted(shapes))}): "
                     "their latencies and throughputs are not directly comparable")
    levels = {c.level_users for c in out.ranked if c.level_users is not None}
    if len(levels) > 1:
        notes.append(f"throughputs come from different load levels ({', '.join(map(str, sorted(levels)))} users)")
    return notes


def recommendation_json(rec: Recommendation) -> dict[str, Any]:
    """``recommend --json``: unrounded, with ``name`` on every choice."""
    def one(c: Choice) -> dict[str, Any]:
        return {"name": c.name, **c.model_dump(mode="json")}
    return {"request": rec.request.model_dump(mode="json"), "ranked": [one(c) for c in rec.ranked],
            "unranked": [one(c) for c in rec.unranked], "excluded": [one(c) for c in rec.excluded],
            "notes": rec.notes}
