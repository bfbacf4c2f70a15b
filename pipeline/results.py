"""Result types that cross layer boundaries: what a run did, per variant, for the CLI, the flow
artifact and ``--json`` output."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class EvalResult(BaseModel):
    """One result of one version on one engine, as evaluators produce it and the registry stores it.

    ``kind`` quality: ``metrics`` holds PPL, KLD, top-1 agreement… on window set ``window_set_id``; speed:
    tokens per second (no window set); serving: a :class:`pipeline.serving.ServingMetrics` dump (the variant
    behind its engine's server under load), never counted as a quality or speed result. ``status`` failed:
    ``error`` says why and ``metrics`` may be empty. ``hardware`` is where it ran (CPU and flags, GPU, threads,
    and a tool environment's exact pip freeze).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["quality", "speed", "serving"]
    engine: str
    engine_version: str | None = None
    window_set_id: str | None = None
    status: Literal["ok", "failed"] = "ok"
    metrics: dict[str, Any] = Field(default_factory=dict)
    hardware: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    wall_s: float | None = None


#: ``kld_method`` of an exact KL-divergence over the whole vocabulary (evaluators.metrics).
KLD_EXACT = "full-vocabulary"


class KLDValue(BaseModel):
    """What a quality result says about KL-divergence, and how to label it wherever it is shown.

    ``exact``: ``value`` is the full-vocabulary mean KLD, what ``llama-perplexity --kl-divergence`` reports,
    and the only kind a ``max_kld`` gate accepts. Otherwise ``value`` is a top-K lower bound (``kind``
    ``lower_bound``: results in the cheaper mode, and every result stored before exact KLD existed, whose
    ``kld_mean`` was that bound) or an estimate (``kind`` ``estimate``: vLLM's old top-256 spreading, where
    ``at_ref_known_fraction`` < 1).
    """

    model_config = ConfigDict(frozen=True)

    value: float | None
    kind: Literal["exact", "lower_bound", "estimate", "missing"]
    method: str | None = None
    ci95: tuple[float, float] | None = None

    @property
    def exact(self) -> bool:
        return self.kind == "exact"

    @property
    def label(self) -> str:
        """A short marker for tables: empty for the exact value."""
        return {"exact": "", "lower_bound": "≥ (top-K lower bound)", "estimate": "~ (estimate)",
                "missing": ""}[self.kind]


def kld_of(metrics: dict[str, Any]) -> KLDValue:
    """The KLD of a quality result's metrics, with its kind (see :class:`KLDValue`)."""
    method = metrics.get("kld_method")
    if method == KLD_EXACT and metrics.get("kld_mean") is not None:
        lo, hi = metrics.get("kld_ci95_low"), metrics.get("kld_ci95_high")
        return KLDValue(value=float(metrics["kld_mean"]), kind="exact", method=method,
                        ci95=(float(lo), float(hi)) if lo is not None and hi is not None else None)
    if metrics.get("kld_topk_lower_bound_mean") is not None:
        lo, hi = metrics.get("kld_topk_lower_bound_ci95_low"), metrics.get("kld_topk_lower_bound_ci95_high")
        return KLDValue(value=float(metrics["kld_topk_lower_bound_mean"]), kind="lower_bound", method=method,
                        ci95=(float(lo), float(hi)) if lo is not None and hi is not None else None)
    if metrics.get("kld_mean") is not None:  # stored before exact KLD: a top-K bound, or vLLM's estimate
        known = metrics.get("at_ref_known_fraction")
        estimate = isinstance(known, int | float) and known < 1.0
        return KLDValue(value=float(metrics["kld_mean"]), kind="estimate" if estimate else "lower_bound",
                        method="top-256 estimate (legacy)" if estimate else "top-K lower bound (legacy)")
    return KLDValue(value=None, kind="missing")


class CrossCheck(BaseModel):
    """A second engine's quality result on the same files (the format's ``cross_check_engine``, or a stand-in
    beside the engine's own): shown as a second, labelled figure, never in place of the engine's."""

    engine: str
    engine_version: str | None = None
    window_set_id: str | None = None
    quality: dict[str, Any] = Field(default_factory=dict)


class VariantOutcome(BaseModel):
    variant: str
    format: str
    ref: str | None = None  # MODEL/VARIANT@N once registered
    created: bool = False  # a new version was registered in this run
    status: str = "pending"  # registered | reused | failed | refused (before any work: flows/preflight.py)
    error: str | None = None
    error_type: str | None = None
    events: list[str] = Field(default_factory=list)
    size: int | None = None
    bpw: float | None = None
    quality: dict[str, Any] | None = None
    speed: dict[str, Any] | None = None
    engine: str | None = None
    engine_version: str | None = None
    window_set_id: str | None = None  # of ``quality``
    speed_engine: str | None = None  # the engine of ``speed``
    cross_checks: list[CrossCheck] = Field(default_factory=list)
    eval_status: str | None = None  # ok | failed | skipped | reused
    eval_error: str | None = None
    #: What a reader of this variant's numbers must know about how its engine runs the model (GGUF: the lineage's
    #: ``llama_cpp_divergences``, converters/gguf/converter.py)
    notes: list[str] = Field(default_factory=list)


class ConvertReport(BaseModel):
    model: str
    source: dict[str, Any]
    window_set: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None
    variants: list[VariantOutcome] = Field(default_factory=list)
    events: list[str] = Field(default_factory=list)
    #: The run's wall time: the flow's, or from deciding to run (resolving the source, starting Prefect's
    #: embedded server: flows/reuse.py) to the flow's end.
    wall_s: float = 0.0
    stage_s: dict[str, float] = Field(default_factory=dict)
    #: One entry per stage of the run's graph (flows/graph.py): stage, pool, key, status (ran | reused |
    #: failed | skipped | not_needed), error, error_type, flow_run_id, work_pool, work_s, wall_s, dispatch_s,
    #: start_s, deps.
    stages: list[dict[str, Any]] = Field(default_factory=list)
    #: True when every stage was reused from the stage ledger and the run was decided before Prefect started
    #: (flows/reuse.py): no flow run, no Prefect table artifacts.
    ledger_only: bool = False
    #: How the embedded executor ran the evaluations that share the CPU (flows/schedule.py EvalSchedule:
    #: evaluations, at_once, threads per slot, reason); None when none had to run.
    eval_schedule: dict[str, Any] | None = None
    #: The noise floor: the KLD between the reference and a second unquantized run that differs only in arithmetic
    #: (evaluators/reference.py), its summary, or ``{"engine": None, "reason": …}``; None where not measured.
    noise_floor: dict[str, Any] | None = None
    #: What the pre-flight decided before any work (flows/preflight.py Preflight.as_dict: the memory available,
    #: the reference chosen and why, every ESTIMATE compared, the disk, refused formats, notes).
    preflight: dict[str, Any] | None = None
    #: The disk this run used, per filesystem it wrote to (free space before and after: flows/quantize.py).
    disk_used: list[dict[str, Any]] = Field(default_factory=list)

    def count(self, event: str) -> int:
        return sum(1 for e in self.events if e == event or e.startswith(event + ":"))

    @property
    def ok(self) -> bool:
        return all(v.status not in ("failed", "refused") for v in self.variants)

    @property
    def refused(self) -> bool:
        """Whether the pre-flight refused part of the plan (those variants were never started)."""
        return any(v.status == "refused" for v in self.variants)
