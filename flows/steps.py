"""Plain functions for every stage of a conversion run. The stage bodies (``flows/stages.py``) call
them; tests call them directly. They pass paths, digests and registry references, never tensors.

This is the only layer that joins converters, evaluators and the registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from converters.base import BuildContext, BuiltVariant, Calibration, Prepared
from converters.checkpoint import Checkpoint, load_checkpoint, scan_nonfinite
from converters.lookup import converter_class
from converters.source import HubOptions, looks_like_hub_id, resolve_source
from evaluators.base import EvalOutcome
from evaluators.engines import engine_for, get_evaluator
from evaluators.reference import reference_key, run_reference
from evaluators.windows import build_window_set
from flows.preflight import Preflight, preflight
from pipeline import __version__
from pipeline.config import Settings
from pipeline.errors import InvalidArtifactError, InvalidSpecError, QuantyardError
from pipeline.formats import format_info
from pipeline.fs import incomplete_pid
from pipeline.plan import EvalSpec, GGUFOptions, Plan
from pipeline.progress import RESOLVE_PARTS, note, stage
from pipeline.real_model import RealRecipe, cached_real_model
from pipeline.resources import Sampler
from pipeline.specs import SourceKind, SourceRef, spec_digest, validate_model_name
from pipeline.texts import calibration_text as pick_calibration_text
from pipeline.texts import eval_text as pick_eval_text
from pipeline.texts import text_sha256
from registry import open_registry
from registry.store import VersionView


@dataclass
class Resolved:
    """A pinned, validated source, and what the pre-flight decided for this machine (flows/preflight.py: the
    plan with its reference chosen and refused formats left out; None where no plan was checked)."""

    source: SourceRef
    model_name: str
    checkpoint: Checkpoint
    preflight: Preflight | None = None

    @property
    def architecture(self) -> str:
        return self.checkpoint.architecture


def default_model_name(source: SourceRef) -> str:
    if source.kind == SourceKind.HUB and source.repo_id:
        return source.repo_id
    name = Path(source.path).name
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name).strip("-.") or "model"
    return cleaned


#: Sources resolved before their flow started (:func:`preresolve`), each taken once by :func:`take_preresolved`.
_PRERESOLVED: dict[tuple[str, str], Resolved] = {}


def _canonical(model: Plan | Settings) -> str:
    return json.dumps(model.model_dump(mode="json"), sort_keys=True)


def _resolve_key(plan: Plan, settings: Settings) -> tuple[str, str]:
    # by value, not identity: the flow receives its parameters as Prefect validated them, as new objects
    return _canonical(plan), _canonical(settings)


def preresolve(plan: Plan, settings: Settings) -> Resolved:
    """:func:`resolve` now, kept for the next :func:`take_preresolved` of the same plan and settings: the
    embedded run (flows/reuse.py) resolves the source while Prefect's embedded server starts. Raises what
    :func:`resolve` raises, keeping nothing."""
    resolved = resolve(plan, settings)
    _PRERESOLVED[_resolve_key(plan, settings)] = resolved
    return resolved


def take_preresolved(plan: Plan, settings: Settings) -> Resolved | None:
    """The source :func:`preresolve` resolved for this plan and settings, once; None if there is none."""
    return _PRERESOLVED.pop(_resolve_key(plan, settings), None)


def forget_preresolved() -> None:
    """Drop every source resolved ahead and not taken (a run that ended before its flow took it)."""
    _PRERESOLVED.clear()


def resolve(plan: Plan, settings: Settings) -> Resolved:
    """Resolve and validate the source, then let every requested format check it (fail fast), and only then
    read every weight for NaN/Inf (the one part that reads the whole checkpoint). A format whose tools are
    missing (``require_tools``: llama.cpp's converter) says so first, before the source is hashed or fetched.

    Its parts emit progress events (:data:`RESOLVE_PARTS`): ``resolve:hash`` (a local folder's content hash;
    ``resolve:fetch`` for a hub revision), ``resolve:check`` (config, tensor shapes, tokenizer, the formats'
    checks, and the pre-flight: flows/preflight.py, which chooses the reference, refuses what cannot fit this
    machine and runs each format's check, so that a refused format leaves the others going) and ``resolve:scan``."""
    where = plan.source.source
    fetch = looks_like_hub_id(where)
    for fmt in plan.by_format():  # a missing tool is said before the source is hashed or downloaded
        converter = make_converter(fmt, plan, settings)
        if hasattr(converter, "require_tools"):
            converter.require_tools()
    with stage(RESOLVE_PARTS["fetch" if fetch else "hash"], where):
        src = resolve_source(where, revision=plan.source.revision, cache_dir=settings.cache_dir,
                             allow_pickle=plan.source.allow_pickle, hub=hub_options(settings))
    allowed = allowed_roots(src)
    with stage(RESOLVE_PARTS["check"], where):
        ckpt = load_checkpoint(Path(src.path), allow_pickle=plan.source.allow_pickle,
                               trust_remote_code=plan.source.trust_remote_code, allowed_roots=allowed,
                               scan_values=False)
        name = validate_model_name(plan.model_name or default_model_name(src))
        if plan.eval.enabled:
            check_window_fits(plan.eval, ckpt)
            check_eval_text(plan.eval, ckpt)
        flight = preflight(plan, ckpt, src, settings,
                           check=lambda fmt, specs: make_converter(fmt, plan, settings).check(ckpt, specs))
        for said in flight.said():
            note(said)
    with stage(RESOLVE_PARTS["scan"], where):
        scan_nonfinite(ckpt)
    return Resolved(source=src, model_name=name, checkpoint=ckpt, preflight=flight)


def allowed_roots(src: SourceRef) -> tuple[Path, ...]:
    """Where a source's files may link to, besides its own folder: a hub revision's repository folder in the
    cache, and likewise the ``blobs`` of a local folder that is a Hugging Face cache snapshot
    (``…/models--OWNER--NAME/snapshots/REV``, the path ``hf download`` prints), whose files are links into it."""
    path = Path(src.path)
    if src.kind == SourceKind.HUB:
        return (path.parent.parent,)
    if path.parent.name == "snapshots" and (path.parent.parent / "blobs").is_dir():
        return (path.parent.parent / "blobs",)
    return ()


def check_window_fits(spec: EvalSpec, ckpt: Checkpoint) -> None:
    """Evaluation windows must fit the context the model was made for (:meth:`Checkpoint.require_context`):
    beyond it perplexity and KLD measure extrapolation, not the quantization, and a model with learned positions
    (GPT-2, OPT) cannot run at all (transformers stops on an index error after the whole conversion).

    Raises:
        InvalidSpecError: the window is longer than the trained context.
    """
    ckpt.require_context(spec.window, "evaluation windows", "--window",
                         note=" (llama-perplexity's -c: the same window)",
                         default=EvalSpec.model_fields["window"].default)


def check_eval_text(spec: EvalSpec, ckpt: Checkpoint) -> None:
    """The evaluation text given as a file (``--eval-text``, or the checkpoint's own ``eval.txt``) must be UTF-8
    and hold at least one window: a token covers at least one byte, so a text of fewer bytes than a window (less
    its BOS) surely holds none. Checked with the source, before any conversion (the window set, built after the
    conversions, counts its tokens exactly). The built-in text is long enough; a dataset is read later.

    Raises:
        ConfigError: the file is not UTF-8.
        InvalidSpecError: the text is shorter than one window.
    """
    if spec.dataset:
        return
    text, origin = pick_eval_text(ckpt.path, file=spec.text_file)
    size = len(text.encode("utf-8"))
    if size + 1 < spec.window:
        raise InvalidSpecError(
            f"the evaluation text ({origin}) has {size} bytes, so fewer than one window of {spec.window} tokens",
            hint="use a longer --eval-text or a smaller --window")


def hub_options(settings: Settings) -> HubOptions:
    return HubOptions(endpoint=settings.hf_endpoint, cache_dir=settings.hf_cache_dir, offline=settings.hf_offline)


def make_converter(fmt: str, plan: Plan, settings: Settings) -> Any:
    """The converter of ``fmt`` for this plan: ``cls(settings)``, plus the plan's options of the format
    when it has any (FormatInfo.plan_options)."""
    cls = converter_class(fmt)
    field = format_info(fmt).plan_options
    return cls(settings) if field is None else cls(settings, options=getattr(plan, field))


def resolve_backends(plan: Plan, settings: Settings) -> Plan:
    """Give every spec that leaves its backend open a concrete one (EXL2: exllamav2 where CUDA and
    ExLlamaV2 are present, else reference-cpu), so names, build keys and lineage say which built it."""
    variants: dict[str, Any] = {}
    for spec in plan.variants:
        conv = make_converter(str(spec.format), plan, settings)
        concrete = conv.resolve_spec(spec) if hasattr(conv, "resolve_spec") else spec
        variants.setdefault(concrete.name, concrete)  # "auto" and an explicit backend may now coincide
    return plan.model_copy(update={"variants": tuple(variants.values())})


def tool_identity(fmt: str, plan: Plan, settings: Settings, spec: Any) -> dict[str, Any]:
    """The tool versions that build ``spec`` (per spec where a format has several backends)."""
    conv = make_converter(fmt, plan, settings)
    return conv.tool_identity_for(spec) if hasattr(conv, "tool_identity_for") else conv.tool_identity()


def build_key(source: SourceRef, spec: Any, tool: dict[str, Any], inputs: dict[str, Any] | None = None) -> str:
    """Cache key of one variant build: source identity, spec, exact tool versions, quantyard version, and
    any other inputs that change the bytes (calibration text, split size...)."""
    body: dict[str, Any] = {"source": source.identity, "spec": spec.model_dump(mode="json"), "tool": tool,
                            "quantyard": __version__}
    if inputs:
        body["inputs"] = inputs
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def build_inputs(plan: Plan, resolved: Resolved, spec: Any, settings: Settings) -> dict[str, Any]:
    """Inputs besides the spec and tools that change a variant's bytes (see :func:`build_key`): what the
    converter's ``build_inputs`` says (GGUF: forced base type, split size, imatrix calibration; AWQ: the
    compute dtype), none for a converter without it."""
    conv = make_converter(str(spec.format), plan, settings)
    if not hasattr(conv, "build_inputs"):
        return {}
    text, origin = calibration_text(resolved)
    ctx = BuildContext(checkpoint=resolved.checkpoint, source=resolved.source, model_name=resolved.model_name,
                       settings=settings, calibration=Calibration(text=text, origin=origin))
    return dict(conv.build_inputs(ctx, spec))


def find_existing(settings: Settings, resolved: Resolved, spec: Any, key: str) -> VersionView | None:
    reg = open_registry(settings)
    return reg.find_build(resolved.model_name, spec.name, key)


def _context(plan: Plan, resolved: Resolved, settings: Settings) -> BuildContext:
    text, origin = calibration_text(resolved)
    return BuildContext(checkpoint=resolved.checkpoint, source=resolved.source, model_name=resolved.model_name,
                        settings=settings, calibration=Calibration(text=text, origin=origin),
                        texts=run_texts(plan, resolved))


def run_texts(plan: Plan, resolved: Resolved) -> dict[str, str]:
    """The texts a run measures and calibrates on, by origin: the evaluation text (when the plan
    evaluates) and the checkpoint's own calibration text (a converter adds the text a variant was calibrated
    on when it differs, see converters/gguf/converter.py)."""
    texts = {}
    if plan.eval.enabled:
        text, origin = eval_text(plan.eval, resolved)
        texts[origin] = text
    text, origin = calibration_text(resolved)
    texts.setdefault(origin, text)
    return texts


def prepare_format(fmt: str, plan: Plan, resolved: Resolved, specs: list[Any], settings: Settings) -> Prepared:
    """Shared work of a format (the GGUF base and, for imatrix quants, the imatrix; the EXL2 measurement).
    Source artifacts the converter can reuse are looked up in the registry first; the ones it produced
    (EXL2 measurement, imatrix and its calibration text) are registered after."""
    conv = make_converter(fmt, plan, settings)
    ctx = _context(plan, resolved, settings)
    reg = open_registry(settings)
    found = {}
    for kind, key in (conv.artifact_keys(ctx, specs) if hasattr(conv, "artifact_keys") else []):
        art = reg.find_source_artifact(resolved.source, kind, key)
        if art is not None:
            found[f"{kind}:{key}"] = reg.artifact_path(art)
    prepared: Prepared = conv.prepare(replace(ctx, artifacts=found), specs)
    for made in prepared.source_artifacts:
        reg.put_source_artifact(model=resolved.model_name, architecture=resolved.architecture,
                                source=resolved.source, kind=made["kind"], key=made["key"], name=made["name"],
                                path=Path(made["path"]), meta=made["meta"])
    return prepared


def build_variant(fmt: str, plan: Plan, resolved: Resolved, prepared: Prepared, spec: Any,
                  settings: Settings, staging: Path) -> BuiltVariant:
    ctx = _context(plan, resolved, settings)
    return make_converter(fmt, plan, settings).build(ctx, prepared, spec, staging / spec.name)


def lineage(plan: Plan, resolved: Resolved, spec: Any, built: BuiltVariant, key: str) -> dict[str, Any]:
    """What a version was built from and how: enough to rebuild it (``validate --reproduce``)."""
    src = resolved.source
    return {
        "source": {"identity": src.identity, "kind": src.kind.value, "repo_id": src.repo_id,
                   "revision": src.revision, "commit": src.commit, "content_hash": src.content_hash,
                   "path": src.path, "architecture": resolved.architecture,
                   "torch_dtype": resolved.checkpoint.torch_dtype},
        "spec": spec.model_dump(mode="json"),
        "spec_digest": spec_digest(spec),
        "options": plan.build_options(str(spec.format)),
        "tool": built.tool,
        "parameters": built.parameters,
        "info": built.info,
        "quantyard_version": __version__,
        "build_key": key,
        "environment": {"python": sys.version.split()[0], "platform": platform.platform()},
        "built_at": datetime.now(UTC).isoformat(),
    }


# --- evaluation ---------------------------------------------------------------------------------


def eval_text(spec: EvalSpec, resolved: Resolved) -> tuple[str, str]:
    """The evaluation text of ``spec`` on this source and where it came from (pipeline.texts.eval_text)."""
    return pick_eval_text(resolved.checkpoint.path, file=spec.text_file, dataset=spec.dataset)


def calibration_text(resolved: Resolved, path: str | None = None) -> tuple[str, str]:
    """The calibration text (``path``, else the checkpoint's own, else the built-in one; pipeline.texts)."""
    return pick_calibration_text(resolved.checkpoint.path, path)


def window_set_key(text_sha: str, spec: EvalSpec) -> str:
    """Registry key of a window set: the text's sha256 and how it is cut into windows."""
    fields: dict[str, Any] = {"text": text_sha, "window": spec.window, "stride": spec.stride,
                              "max_windows": spec.max_windows}
    if spec.score_from != 1:  # only when set, so registries made before the option keep their keys
        fields["score_from"] = spec.score_from
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def ensure_window_set(settings: Settings, resolved: Resolved, spec: EvalSpec) -> tuple[Path, dict[str, Any], bool]:
    """The window set for this source and settings, from the registry or built and registered now.

    Returns (path to the npz in the blob store, its metadata, whether it was built now).
    """
    text, origin = eval_text(spec, resolved)
    key = window_set_key(text_sha256(text), spec)
    reg = open_registry(settings)
    found = reg.find_source_artifact(resolved.source, "window_set", key)
    if found is not None:
        return reg.artifact_path(found), found.meta, False
    ws = build_window_set(resolved.checkpoint.path, text, window=spec.window, stride=spec.stride,
                          max_windows=spec.max_windows, score_from=spec.score_from)
    with scratch_dir(settings) as tmp:
        path = Path(tmp) / "windows.npz"
        ws.save(path)
        meta = {**ws.meta(), "origin": origin, "max_windows": spec.max_windows}
        art = reg.put_source_artifact(model=resolved.model_name, architecture=resolved.architecture,
                                      source=resolved.source, kind="window_set", key=key,
                                      name=f"windows-{ws.id[:12]}.npz", path=path, meta=meta)
    return reg.artifact_path(art), art.meta, True


def ensure_reference(settings: Settings, resolved: Resolved, windows: Path, ws_meta: dict[str, Any],
                     spec: EvalSpec) -> tuple[Path, dict[str, Any], bool]:
    """Reference log-probs for (source, window set), computed once and reused from the registry."""
    key = reference_key(str(ws_meta["id"]), spec)
    reg = open_registry(settings)
    found = reg.find_source_artifact(resolved.source, "reference", key)
    if found is not None:
        return reg.artifact_path(found), found.meta, False
    model_file, env, commit = (reference_gguf(settings, resolved, spec) if spec.reference_engine == "llama.cpp"
                               else (None, None, None))
    with scratch_dir(settings) as tmp:
        with Sampler() as sampler:
            out, summary = run_reference(resolved.checkpoint.path, windows, Path(tmp) / "ref", spec, settings,
                                         model_file=model_file, env=env, engine_commit=commit)
        if sampler.usage is not None:
            summary["usage"] = sampler.usage.as_dict()
        if spec.reference_reason:
            summary["reason"] = spec.reference_reason
        assert out.arrays is not None
        art = reg.put_source_artifact(model=resolved.model_name, architecture=resolved.architecture,
                                      source=resolved.source, kind="reference", key=key,
                                      name=f"reference-{key[:12]}.npz", path=out.arrays,
                                      meta={**summary, "window_set_id": ws_meta["id"]})
    return reg.artifact_path(art), art.meta, True


#: What the noise floor's summary keeps of its quality metrics (a registry artifact's meta and the report).
FLOOR_FIELDS = ("kld_mean", "kld_ci95_low", "kld_ci95_high", "kld_p99", "kld_p999", "kld_max", "top1_agreement",
                "ppl", "ref_ppl", "delta_ppl_pct", "kld_method")


def ensure_noise_floor(settings: Settings, resolved: Resolved, windows: Path, ws_meta: dict[str, Any],
                       reference: Path, spec: EvalSpec, gguf_base: str | None) -> dict[str, Any] | None:
    """The noise floor for (source, window set, reference), measured once and kept as a source artifact: the
    second unquantized run of evaluators/reference.py ``noise_floor_engine`` scored against the reference.
    ``gguf_base``: the run's GGUF base type where it builds one (llama.cpp measures the floor on it). None when
    ``spec.noise_floor`` is off; ``{"engine": None, "reason": …}`` where no second run fits."""
    from evaluators.reference import noise_floor_engine, noise_floor_key
    from pipeline import resources
    from pipeline.shown import NOISE_FLOOR_KIND

    if not spec.noise_floor:
        return None
    engine, why = noise_floor_engine(spec, resolved.checkpoint.facts, resources.memory(settings.memory_budget),
                                     gguf_base is not None)
    if engine is None:
        return {"engine": None, "reason": why}
    ref_key = reference_key(str(ws_meta["id"]), spec)
    key = noise_floor_key(ref_key, engine)
    reg = open_registry(settings)
    found = reg.find_source_artifact(resolved.source, NOISE_FLOOR_KIND, key)
    if found is not None:
        return dict(found.meta)
    try:
        return _measure_noise_floor(settings, resolved, windows, ws_meta, reference, spec, engine, why, gguf_base,
                                    ref_key, key)
    except QuantyardError as exc:  # the floor is a second opinion: its failure never fails the reference
        said = f"no noise floor: {engine} could not run the unquantized model ({type(exc).__name__}: {exc})"
        note(said)
        return {"engine": None, "reason": said}


def _measure_noise_floor(settings: Settings, resolved: Resolved, windows: Path, ws_meta: dict[str, Any],
                         reference: Path, spec: EvalSpec, engine: str, why: str, gguf_base: str | None,
                         ref_key: str, key: str) -> dict[str, Any]:
    from evaluators.reference import run_noise_floor
    from pipeline.plan import reference_defaults
    from pipeline.shown import NOISE_FLOOR_KIND

    model_file, env = None, None
    if engine == "llama.cpp":
        dtype, _ = reference_defaults("llama.cpp", None, None, gguf_base or "auto")
        model_file, env, _ = reference_gguf(settings, resolved, spec.model_copy(update={
            "reference_engine": "llama.cpp", "reference_dtype": dtype, "reference_device": "cpu"}))
    reg = open_registry(settings)
    with scratch_dir(settings) as tmp, stage("reference:noise-floor", engine):
        with Sampler() as sampler:
            metrics = run_noise_floor(engine, resolved.checkpoint.path, model_file, windows, reference,
                                      Path(tmp) / "floor", spec, settings, env)
        meta = {**{k: metrics.get(k) for k in FLOOR_FIELDS}, "engine": engine, "reason": why,
                "engine_version": metrics.get("engine_version"), "reference_key": ref_key,
                "window_set_id": ws_meta["id"], "model_file": model_file.name if model_file else None,
                "usage": sampler.usage.as_dict() if sampler.usage is not None else None}
        path = Path(tmp) / "noise-floor.json"
        path.write_text(json.dumps({**meta, "metrics": metrics}, default=str))
        art = reg.put_source_artifact(model=resolved.model_name, architecture=resolved.architecture,
                                      source=resolved.source, kind=NOISE_FLOOR_KIND, key=key,
                                      name=f"noise-floor-{key[:12]}.json", path=path, meta=meta)
    return dict(art.meta)


def reference_gguf(settings: Settings, resolved: Resolved,
                   spec: EvalSpec) -> tuple[Path, dict[str, str], str | None]:
    """The unquantized GGUF the llama.cpp reference runs, the environment its runner needs and the llama.cpp
    commit (named in the engine version): the GGUF
    converter's cached base of this source (converted only when missing; the same file the GGUF variants
    are quantized from when the types agree), F32/F16/BF16 as the spec's dtype says."""
    from evaluators.reference import gguf_reference_type

    conv = converter_class("gguf")(settings, GGUFOptions(base_type=gguf_reference_type(spec)))
    ctx = BuildContext(checkpoint=resolved.checkpoint, source=resolved.source, model_name=resolved.model_name,
                       settings=settings)
    prepared = conv.prepare(ctx, [])
    tools = conv.llama_cpp()
    return Path(prepared.paths["base"]), {"LD_LIBRARY_PATH": tools.env()["LD_LIBRARY_PATH"]}, tools.commit


def _tmp_root(settings: Settings) -> Path:
    root = settings.work_root / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return root


def scratch_dir(settings: Settings, kind: str = "tmp") -> tempfile.TemporaryDirectory[str]:
    """A temporary folder under the work dir, named after this process so that a later run can tell
    the leftovers of a killed run (dead pid) from those of a run still going (see sweep_stale)."""
    root = settings.work_root / kind
    root.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix=f"{os.getpid()}-", dir=root)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(settings: Settings) -> list[Path]:
    """Remove scratch folders and partial files left by killed runs (their pid is gone)."""
    removed = []
    for kind in ("tmp", "staging", "serve"):
        root = settings.work_root / kind
        if not root.is_dir():
            continue
        for entry in root.iterdir():
            owner = entry.name.split("-", 1)[0]
            if owner.isdigit() and not _pid_alive(int(owner)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    # pipeline.fs names, files or folders: gguf-base/<key>/x.gguf.<pid>-<hex>.incomplete,
    # imatrix-<key>.gguf.<pid>-<hex>.incomplete.gguf, an AWQ output folder <variant>.<pid>-<hex>.incomplete
    for partial in _partials(settings.work_root):
        pid = incomplete_pid(partial)
        if pid is None or _pid_alive(pid) or not (partial.exists() or partial.is_symlink()):
            continue  # not ours, still being written, or inside a folder removed just before
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)
        removed.append(partial)
    return removed


def _partials(root: Path) -> list[Path]:
    """Every file, folder or link under ``root`` whose name holds ``.incomplete``, sorted. Found by ``os.walk``,
    which passes over a folder that vanishes while it walks: other runs, and this run's own thread writing the
    source's records beside a build (flows/stages.py, InProcess.flushed_beside), make and remove scratch folders
    under the same root meanwhile (``Path.rglob`` raised FileNotFoundError there)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        found.extend(Path(dirpath) / name for name in (*dirnames, *filenames) if ".incomplete" in name)
    return sorted(found)


def has_quality_result(version: VersionView, engine: str, window_set_id: str, ref_key: str) -> bool:
    """Whether ``version`` has a successful quality result of ``engine`` on this window set against this
    reference (its key covers the reference's engine, dtype and storage, so the KLD mode too)."""
    return any(r.kind == "quality" and r.status == "ok" and r.engine == engine and r.window_set_id == window_set_id
               and r.metrics.get("reference_key") == ref_key for r in version.results)


def evaluate_version(settings: Settings, ref: str, fmt: str, windows: Path, ws_meta: dict[str, Any],
                     reference: Path, spec: EvalSpec, engine: str | None = None) -> EvalOutcome:
    """Evaluate one registered version on ``engine`` (default: its format's engine) and attach the results.

    Raises EngineError (after recording a failed result) when the engine fails.
    """
    reg = open_registry(settings)
    version = reg.get_version(ref)
    fallback = None
    if engine is None:
        engine, fallback = engine_for(fmt, settings)
    evaluator = get_evaluator(engine)
    with scratch_dir(settings) as tmp:
        model_dir = Path(tmp) / "model"
        files = reg.link_files(ref, model_dir)
        model = model_path(fmt, files, model_dir)
        try:
            with Sampler() as sampler:
                outcome = evaluator.evaluate(model, windows=windows, window_set_id=str(ws_meta["id"]),
                                             reference=reference, spec=spec, out_dir=Path(tmp) / "eval",
                                             settings=settings)
        except QuantyardError as exc:
            reg.add_result(ref, {"kind": "quality", "engine": engine, "status": "failed",
                                 "window_set_id": ws_meta["id"], "error": _error_text(exc)})
            raise
    outcome.fallback = outcome.fallback or fallback
    if outcome.quality is not None:  # which reference the numbers are against: reuse and compare check it
        outcome.quality["reference_key"] = reference_key(str(ws_meta["id"]), spec)
    usage = sampler.usage.as_dict() if sampler.usage is not None else None
    for part in (outcome.quality, outcome.speed):  # what the evaluation took (quality and speed in one run)
        if part is not None and usage is not None:
            part["usage"] = usage
    for record in outcome.records():
        reg.add_result(version.ref, record)
    return outcome


def _error_text(exc: QuantyardError) -> str:
    tail = getattr(exc, "stderr_tail", "") or ""
    return exc.summary() + (f"\n--- stderr tail ---\n{tail[-2000:]}" if tail else "")


def model_path(fmt: str, files: list[Path], folder: Path) -> Path:
    """What an engine loads: the (first) file of a single-file format (the first part of a split GGUF), or
    the folder.

    Raises InvalidArtifactError when a single-file format's version holds no such file."""
    info = format_info(fmt)
    if not info.single_file:
        return folder
    found = sorted(f for f in files if f.suffix == info.suffix)
    if not found:
        raise InvalidArtifactError(f"{folder} holds no {info.suffix} file of a {info.label} variant",
                                   hint="check the version's files with `quantyard show`")
    return found[0]


def real_checkpoint(settings: Settings, recipe: RealRecipe | None = None) -> Path:
    """The real pretrained checkpoint (pipeline/real_model.py), built once and cached; its tokenizer is
    checked against llama.cpp's on the original GGUF, on the whole evaluation and calibration texts."""
    from converters.gguf.tokenizer import check_parity
    from pipeline.llama_cpp import llama_cpp_toolchain
    from pipeline.proc import failure_log_dir

    def parity(gguf: Path, checkpoint: Path, texts: dict[str, str], log_dir: Path) -> dict[str, Any]:
        return check_parity(gguf, checkpoint, python=settings.core_python, env=llama_cpp_toolchain(settings).env(),
                            log_dir=log_dir, timeout_s=600, allow=False, texts=texts,
                            keep=failure_log_dir(settings.logs_root))

    recipe = recipe or RealRecipe()
    return cached_real_model(settings.cache_dir, settings.core_python, parity if recipe.fix_pretokenizer else None,
                             recipe)


def cleanup(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
