"""The pre-flight: what a plan asks of this machine, checked before any work.

It runs with the source's checks (flows/steps.py ``resolve``: after the config, shapes, tokenizer and formats are
checked, before the NaN/Inf scan reads the weights, and before any conversion or evaluation), from the
checkpoint's config and safetensors headers alone, and decides:

* **the reference engine** where the plan leaves it ``auto`` (evaluators.reference.choose_reference: transformers
  in float32 where it fits comfortably, else the unquantized GGUF base on llama.cpp, memory-mapped), or refuses a
  named one that cannot fit. A reference that cannot fit stops the plan: nothing can be evaluated without it.
* **each format**, from its converter's footprint and its engines' needs (pipeline/footprint.py: ESTIMATES): a
  format whose conversion or evaluation cannot fit in the available memory, or whose own checks fail, is
  refused, and the plan goes on with the others (its variants are reported as refused, with the numbers); a plan
  whose every format is refused stops with the first refusal. A cross-check engine (AWQ's transformers) that
  cannot fit is left out of the plan, and the report says why.
* **disk**: every file the plan will write that is not there yet (the GGUF base, each variant in the work
  folder, its copy in the blob store where that is another filesystem, the exact-KLD reference store), summed
  per filesystem against its free space less ``Settings.disk_headroom_mb``; a plan that cannot fit is refused.

Memory is what :func:`pipeline.resources.memory` says is available (MemAvailable, a cgroup limit, or
``QUANTYARD_MEMORY_BUDGET``); stages run one after another, so each need is compared with it alone. The
result (:class:`Preflight`) is printed, and recorded in the run's report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from converters.base import Footprint
from converters.checkpoint import Checkpoint, model_facts, read_facts
from converters.lookup import converter_class
from evaluators.engines import engine_for, engines_of, get_evaluator
from evaluators.reference import choose_reference, reference_need
from pipeline import resources
from pipeline.config import Settings
from pipeline.envs import detect_accelerator
from pipeline.errors import DiskFullError, InsufficientMemoryError, QuantyardError
from pipeline.footprint import ModelFacts, Need
from pipeline.formats import format_info
from pipeline.plan import EvalSpec, Plan
from pipeline.resources import GIB, Memory, gib
from pipeline.results import ConvertReport, VariantOutcome
from pipeline.specs import SourceKind, SourceRef
from pipeline.texts import eval_text
from registry import open_registry


@dataclass(frozen=True)
class DiskNeed:
    """What a plan will write on one filesystem (``where``: a folder on it) against its free space."""

    where: str
    needed: int
    free: int
    items: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        parts = ", ".join(f"{what} {n / GIB:.2f}" for what, n in self.items)
        return f"~{gib(self.needed)} on {self.where} (ESTIMATE: {parts} GiB), {gib(self.free)} free"


@dataclass
class Preflight:
    """The pre-flight's decisions (module docstring): ``plan`` with its reference chosen, refused formats and
    unfitting cross-checks left out; ``refused`` by format; every estimate compared; notes to print."""

    plan: Plan
    memory: Memory
    needs: list[tuple[Need, bool]] = field(default_factory=list)  # (estimate, fits)
    disk: list[DiskNeed] = field(default_factory=list)
    refused: dict[str, QuantyardError] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def said(self) -> list[str]:
        """What to tell the user before the work starts: the notes, then each refusal."""
        return [*self.notes, *(f"{format_info(fmt).label} refused: {exc.summary()}"
                               for fmt, exc in self.refused.items())]

    def as_dict(self) -> dict[str, Any]:
        """What the report records (ConvertReport.preflight)."""
        return {"memory": {"available": self.memory.available, "total": self.memory.total,
                           "limited_by": self.memory.limited_by},
                "reference": {"engine": self.plan.eval.reference_engine, "dtype": self.plan.eval.reference_dtype,
                              "device": self.plan.eval.reference_device, "reason": self.plan.eval.reference_reason}
                if self.plan.eval.enabled else None,
                "needs": [{"what": n.what, "stage": n.stage, "memory": n.memory, "fits": ok, "estimate": True,
                           "parts": dict(n.parts)} for n, ok in self.needs],
                "disk": [{"where": d.where, "needed": d.needed, "free": d.free, "estimate": True,
                          "items": dict(d.items)} for d in self.disk],
                "refused": {fmt: exc.summary() for fmt, exc in self.refused.items()},
                "notes": list(self.notes)}


def settle_reference(plan: Plan, facts: ModelFacts, settings: Settings) -> Plan:
    """``plan`` with its reference engine chosen or checked for this machine (choose_reference); unchanged when
    it does not evaluate. Raises InsufficientMemoryError (the reference cannot fit)."""
    if not plan.eval.enabled:
        return plan
    return plan.model_copy(update={"eval": settle_eval(plan.eval, facts, settings, plan.gguf.base_type)})


def settle_eval(spec: EvalSpec, facts: ModelFacts, settings: Settings, gguf_base: str = "auto") -> EvalSpec:
    """``spec`` with its reference engine chosen or checked for this machine (evaluators.reference.choose_reference).
    Raises InsufficientMemoryError (the reference cannot fit)."""
    return choose_reference(spec, facts, resources.memory(settings.memory_budget), gguf_base=gguf_base,
                            gpu_free=gpu_free(settings))


def source_facts(source: SourceRef, settings: Settings, download: bool = False) -> ModelFacts | None:
    """The source's shape from its config.json and safetensors headers (milliseconds), for choosing its reference
    before it is resolved: a folder where it is; a hub revision from its snapshot in the cache, or with
    ``download`` from the Hub's API (config.json and the safetensors metadata, no weights); None otherwise."""
    if source.kind == SourceKind.LOCAL:
        return read_facts(Path(source.path))
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    repo, commit = str(source.repo_id), source.commit
    try:
        folder = snapshot_download(repo, revision=commit, local_files_only=True, cache_dir=settings.hf_cache_dir)
        return read_facts(Path(folder))
    except Exception:  # not in the cache (huggingface_hub raises several kinds)
        if not download:
            return None
    config = json.loads(Path(hf_hub_download(repo, "config.json", revision=commit, cache_dir=settings.hf_cache_dir,
                                             endpoint=settings.hf_endpoint)).read_text())
    meta = HfApi(endpoint=settings.hf_endpoint).get_safetensors_metadata(repo, revision=commit)
    shapes = {n: tuple(t.shape) for f in meta.files_metadata.values() for n, t in f.tensors.items()}
    width = {"F32": 4, "BF16": 2, "F16": 2}
    stored = sum(width.get(d, 2) * n for d, n in meta.parameter_count.items())
    dtype = max(meta.parameter_count, key=lambda d: meta.parameter_count[d], default="F32")
    return model_facts(config, shapes, stored, {"F32": "float32", "F16": "float16"}.get(dtype, "bfloat16"))


def gpu_free(settings: Settings) -> int | None:
    """Free memory of the first CUDA GPU (nvidia-smi), None without one."""
    return resources.gpu_free() if detect_accelerator(settings) == "cuda" else None


def preflight(plan: Plan, checkpoint: Checkpoint, source: SourceRef, settings: Settings, check: Any) -> Preflight:
    """Decide the plan for this machine (module docstring). ``check(fmt, specs)``: the format's own checks
    (raising its typed error), run here so a failing format is refused like one that cannot fit.

    Raises:
        InsufficientMemoryError: the reference cannot fit, or no format can.
        DiskFullError: what the plan writes does not fit a filesystem it writes to.
        QuantyardError: every format was refused (the first format's error).
    """
    facts = checkpoint.facts
    memory = resources.memory(settings.memory_budget)
    plan = settle_reference(plan, facts, settings)
    out = Preflight(plan=plan, memory=memory)
    if plan.eval.enabled:
        out.needs.append((reference_need(plan.eval, facts).at("reference"), True))
        if plan.eval.reference_reason:
            out.notes.append(f"reference: {plan.eval.reference_reason}")
    sizes: dict[str, int] = {}
    work = 0
    cross_check = plan.eval.cross_check
    for fmt, specs in plan.by_format().items():
        try:
            check(fmt, specs)
            foot = _footprint(fmt, plan, checkpoint, source, settings, specs)
            refusal, skip_cross = _memory(out, fmt, facts, foot, specs, plan, settings)
        except QuantyardError as exc:
            out.refused[fmt] = exc
            continue
        if refusal is not None:
            out.refused[fmt] = refusal
            continue
        cross_check = cross_check and not skip_cross
        sizes.update(foot.variant_bytes)
        work += foot.work_bytes
    if out.refused and len(out.refused) == len(plan.by_format()):
        raise next(iter(out.refused.values()))
    kept = tuple(v for v in plan.variants if str(v.format) not in out.refused)
    out.plan = plan.model_copy(update={"variants": kept,
                                       "eval": plan.eval.model_copy(update={"cross_check": cross_check})})
    out.disk = _disk(out.plan, checkpoint, settings, sizes, work)
    return out


def _footprint(fmt: str, plan: Plan, checkpoint: Checkpoint, source: SourceRef, settings: Settings,
               specs: list[Any]) -> Footprint:
    cls = converter_class(fmt)
    field_name = format_info(fmt).plan_options
    conv = cls(settings) if field_name is None else cls(settings, options=getattr(plan, field_name))
    footprint: Footprint = conv.footprint(checkpoint, source, specs)
    return footprint


def _memory(out: Preflight, fmt: str, facts: ModelFacts, foot: Footprint, specs: list[Any], plan: Plan,
            settings: Settings) -> tuple[InsufficientMemoryError | None, bool]:
    """Compare a format's conversion and evaluation needs with the memory; returns (its refusal or None, whether
    its cross-check engine must be left out)."""
    available = out.memory.available
    needs: list[Need] = list(foot.needs)
    engines = engines_of(fmt, plan.eval.cross_check) if plan.eval.enabled else []
    if engines:  # the engine that will evaluate here: the format's own, or its stand-in where that cannot run
        engines[0] = engine_for(fmt, settings)[0]
    main = engines[:1]
    skip_cross = False
    for engine in engines:
        evaluator = get_evaluator(engine)
        for spec in specs:
            need = evaluator.memory_need(facts, foot.variant_bytes.get(spec.name, facts.stored_bytes),
                                         spec.model_dump(mode="json"), plan.eval, settings).at(
                f"evaluate:{spec.name}:{engine}")
            if engine not in main and need.memory > available:
                skip_cross = True
                out.needs.append((need, False))
                out.notes.append(f"{engine} cross-check of {format_info(fmt).label} left out: {need.describe()}; "
                                 f"{out.memory.describe()}")
                break
            needs.append(need)
    worst = [n for n in needs if n.memory > available]
    out.needs.extend((n, n.memory <= available) for n in needs)
    if not worst:
        return None, skip_cross
    top = max(worst, key=lambda n: n.memory)
    label = format_info(fmt).label
    hint = (f"leave {label} out of this plan (the other formats go on without it), or run it on a machine with "
            f"~{gib(top.memory)} available or on a GPU work pool (quantyard orchestrate)"
            + format_info(fmt).lower_memory)
    return InsufficientMemoryError(f"{label}: {top.describe()}; {out.memory.describe()}", needed=top.memory,
                                   available=available, hint=hint), skip_cross


def _disk(plan: Plan, checkpoint: Checkpoint, settings: Settings, sizes: dict[str, int],
          work_bytes: int) -> list[DiskNeed]:
    """Per filesystem: what the plan writes there that is not there yet, against its free space (less the
    headroom). Raises DiskFullError naming the first that does not fit."""
    work = settings.work_root
    items: dict[Path, list[tuple[str, int]]] = {}

    def add(where: Path, what: str, n: int) -> None:
        if n > 0:
            items.setdefault(where, []).append((what, n))

    add(work, "shared work files (the GGUF base)", work_bytes)
    add(work, "variants (staging)", sum(sizes.values()))
    store = _store_bytes(plan, checkpoint)
    add(work, "reference store (exact KLD)", store)
    blob_root = getattr(open_registry(settings).blobs, "root", None)
    if isinstance(blob_root, Path) and resources.device_of(blob_root) != resources.device_of(work):
        add(blob_root, "variants (blob store copy)", sum(sizes.values()))
        add(blob_root, "GGUF base and reference (blob store copy)", work_bytes + store)
    out = []
    for where, parts in items.items():
        need = sum(n for _, n in parts)
        free = resources.disk_free(where)
        disk = DiskNeed(str(where), need, free, tuple(parts))
        if need + (settings.disk_headroom_mb << 20) > free:
            raise DiskFullError(where, needed=need, free=free, what=f"what this plan writes ({disk.describe()})",
                                hint="refused before any work: free space there, point QUANTYARD_WORK_DIR / "
                                     "--registry at a larger disk, build fewer variants, or evaluate fewer windows "
                                     "(--max-windows)")
        out.append(disk)
    return out


def _store_bytes(plan: Plan, checkpoint: Checkpoint) -> int:
    """ESTIMATE of the exact-KLD reference store (2 bytes per vocabulary entry per scored position): the windows the
    evaluation text holds at a conservative 3 bytes per token, or ``max_windows``."""
    spec = plan.eval
    if not spec.enabled or spec.kld != "exact" or spec.dataset:
        return 0
    vocab = checkpoint.facts.vocab
    text, _ = eval_text(checkpoint.path, file=spec.text_file)
    windows = max(1, (len(text.encode("utf-8")) // 3) // spec.stride)
    if spec.max_windows is not None:
        windows = min(windows, spec.max_windows)
    scored = windows * (spec.window - spec.score_from)
    return 2 * vocab * scored  # the exact count is checked again once the window set exists (evaluators/reference.py)


def add_preflight(out: ConvertReport, asked: Plan, flight: Preflight | None) -> None:
    """The pre-flight's decisions in a run's report: each variant of a refused format as ``refused`` with its
    reason, the estimates and the choices (``out.preflight``)."""
    if flight is None:
        return
    out.preflight = flight.as_dict()
    for spec in asked.variants:
        exc = flight.refused.get(str(spec.format))
        if exc is not None:
            out.variants.append(VariantOutcome(variant=spec.name, format=str(spec.format), status="refused",
                                               error=exc.summary(), error_type=type(exc).__name__))


def disk_free_by_filesystem(settings: Settings) -> dict[str, int]:
    """Free bytes of each filesystem a run writes to (the work folder, a local blob store), by a folder on it."""
    roots = [settings.work_root]
    blob_root = getattr(open_registry(settings).blobs, "root", None)
    if isinstance(blob_root, Path):
        roots.append(blob_root)
    seen: dict[int, str] = {}
    for root in roots:
        seen.setdefault(resources.device_of(root), str(root))
    return {where: resources.disk_free(Path(where)) for where in seen.values()}


def disk_used(before: dict[str, int], settings: Settings) -> list[dict[str, Any]]:
    """The free space each filesystem lost during a run (``before``: :func:`disk_free_by_filesystem` at its start).
    Another process writing there meanwhile counts too: it is the filesystem's, not only the run's."""
    out = []
    for where, free in before.items():
        after = resources.disk_free(Path(where))
        used = free - after
        out.append({"where": where, "free_before": free, "free_after": after, "used": used,
                    "describe": f"{where}: {used / GIB:+.2f} GiB used by the run (free {gib(free)} → {gib(after)})"})
    return out


def estimate_of(stage: str, needs: list[dict[str, Any]]) -> int | None:
    """The largest ESTIMATE a report's pre-flight made for ``stage`` (its ``needs``, matched by their stage
    patterns: ``build:*`` matches ``build:Q8_0``), None where it made none."""
    from fnmatch import fnmatchcase

    found = [int(n["memory"]) for n in needs if n.get("stage") and fnmatchcase(stage, n["stage"])]
    return max(found) if found else None
