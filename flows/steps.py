"""Plain functions for every stage of a conversion run. ``flows/tasks.py`` wraps them as Prefect
tasks; tests call them directly. They pass paths, digests and registry references, never tensors.

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

from converters import converter_class
from converters.base import BuildContext, BuiltVariant, Calibration, Prepared
from converters.checkpoint import Checkpoint, load_checkpoint
from converters.source import HubOptions, resolve_source
from evaluators import engine_for, get_evaluator
from evaluators.base import EvalOutcome
from evaluators.reference import reference_key, run_reference
from evaluators.windows import build_window_set
from pipeline import __version__
from pipeline.config import Settings
from pipeline.demo_model import CALIB_TEXT, EVAL_TEXT, DemoRecipe, corpus
from pipeline.errors import ConfigError, QuantyardError
from pipeline.plan import EvalSpec, Plan
from pipeline.real_model import RealRecipe, cached_real_model, text_origin
from pipeline.specs import QuantFormat, SourceKind, SourceRef, spec_digest, validate_model_name
from registry import open_registry
from registry.store import RegisterRequest, VersionView


@dataclass
class Resolved:
    """A pinned, validated source."""

    source: SourceRef
    model_name: str
    checkpoint: Checkpoint

    @property
    def architecture(self) -> str:
        return self.checkpoint.architecture


def default_model_name(source: SourceRef) -> str:
    if source.kind == SourceKind.HUB and source.repo_id:
        return source.repo_id
    name = Path(source.path).name
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name).strip("-.") or "model"
    return cleaned


def resolve(plan: Plan, settings: Settings) -> Resolved:
    """Resolve and validate the source, then let every requested format check it (fail fast)."""
    src = resolve_source(plan.source.source, revision=plan.source.revision, cache_dir=settings.cache_dir,
                         allow_pickle=plan.source.allow_pickle, hub=hub_options(settings))
    allowed = (Path(src.path).parent.parent,) if src.kind == SourceKind.HUB else ()
    ckpt = load_checkpoint(Path(src.path), allow_pickle=plan.source.allow_pickle,
                           trust_remote_code=plan.source.trust_remote_code, allowed_roots=allowed)
    name = validate_model_name(plan.model_name or default_model_name(src))
    resolved = Resolved(source=src, model_name=name, checkpoint=ckpt)
    for fmt, specs in plan.by_format().items():
        make_converter(fmt, plan, settings).check(ckpt, specs)
    return resolved


def hub_options(settings: Settings) -> HubOptions:
    return HubOptions(endpoint=settings.hf_endpoint, cache_dir=settings.hf_cache_dir, offline=settings.hf_offline)


def make_converter(fmt: str, plan: Plan, settings: Settings, imatrix: Any = None) -> Any:
    cls = converter_class(fmt)
    if fmt == "gguf":
        return cls(settings.llama_cpp_tools_dir, python=settings.core_python, options=plan.gguf, imatrix=imatrix)
    return cls(settings)


def resolve_backends(plan: Plan, settings: Settings) -> Plan:
    """Give every spec that leaves its backend open a concrete one (EXL2: exllamav2 where CUDA and
    ExLlamaV2 are present, else reference-cpu), so names, build keys and lineage say which built it."""
    variants: dict[str, Any] = {}
    for spec in plan.variants:
        conv = make_converter(spec.format.value, plan, settings)
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
    """Inputs besides the spec and tools that change a variant's bytes (see :func:`build_key`)."""
    from flows import gguf_steps

    if spec.format == QuantFormat.AWQ:
        compute = make_converter("awq", plan, settings).compute_dtype(resolved.checkpoint)
        return {"compute_dtype": compute} if compute else {}
    return gguf_steps.build_inputs(plan, resolved, spec, settings)


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
    evaluates) and the calibration text the plan names, else the checkpoint's own."""
    texts = {}
    if plan.eval.enabled:
        text, origin = eval_text(plan.eval, resolved)
        texts[origin] = text
    text, origin = calibration_text(resolved, plan.gguf.calibration.file)
    texts.setdefault(origin, text)
    return texts


def prepare_format(fmt: str, plan: Plan, resolved: Resolved, specs: list[Any], settings: Settings) -> Prepared:
    """Shared work of a format (the GGUF base and, for imatrix quants, the imatrix; the EXL2 measurement).
    Source artifacts the converter can reuse are looked up in the registry first; the ones it produced
    (EXL2 measurement, imatrix and its calibration text) are registered after."""
    from flows import gguf_steps

    imatrix = None
    if fmt == "gguf" and any(getattr(s, "imatrix", False) for s in specs):
        imatrix = gguf_steps.imatrix_request(plan, resolved, settings)
    conv = make_converter(fmt, plan, settings, imatrix=imatrix)
    ctx = _context(plan, resolved, settings)
    reg = open_registry(settings)
    found = {}
    for kind, key in (conv.artifact_keys(ctx, specs) if hasattr(conv, "artifact_keys") else []):
        art = reg.find_source_artifact(resolved.source, kind, key)
        if art is not None:
            found[f"{kind}:{key}"] = reg.artifact_path(art)
    prepared: Prepared = conv.prepare(replace(ctx, artifacts=found), specs)
    for art in prepared.source_artifacts:
        reg.put_source_artifact(model=resolved.model_name, architecture=resolved.architecture,
                                source=resolved.source, kind=art["kind"], key=art["key"], name=art["name"],
                                path=Path(art["path"]), meta=art["meta"])
    if imatrix is not None:
        gguf_steps.register_imatrix(settings, resolved, prepared, ctx.file_stem)
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
        "options": plan.build_options(spec.format.value),
        "tool": built.tool,
        "parameters": built.parameters,
        "info": built.info,
        "quantyard_version": __version__,
        "build_key": key,
        "environment": {"python": sys.version.split()[0], "platform": platform.platform()},
        "built_at": datetime.now(UTC).isoformat(),
    }


def register(settings: Settings, plan: Plan, resolved: Resolved, spec: Any, built: BuiltVariant,
             key: str) -> VersionView:
    reg = open_registry(settings)
    return reg.register_version(RegisterRequest(
        model=resolved.model_name, architecture=resolved.architecture, source=resolved.source,
        variant=spec.name, format=spec.format.value, spec=spec.model_dump(mode="json"), build_key=key,
        lineage=lineage(plan, resolved, spec, built, key), files=built.files, force=plan.force))


# --- evaluation ---------------------------------------------------------------------------------


def eval_text(spec: EvalSpec, resolved: Resolved) -> tuple[str, str]:
    """The evaluation text and where it came from: --eval-text, a dataset, the checkpoint's own
    held-out ``eval.txt`` (the demo), or the demo corpus' held-out split (offline default)."""
    if spec.text_file:
        path = Path(spec.text_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"evaluation text {path} does not exist", hint="pass an existing --eval-text file")
        return path.read_text(encoding="utf-8"), f"file:{path.name}"
    if spec.dataset:
        return _dataset_text(spec.dataset), f"dataset:{spec.dataset}"
    own = resolved.checkpoint.path / EVAL_TEXT
    if own.is_file():
        return own.read_text(encoding="utf-8"), text_origin(resolved.checkpoint.path, EVAL_TEXT)
    return corpus(DemoRecipe())["eval"], "builtin:python-stdlib-heldout"


def calibration_text(resolved: Resolved, path: str | None = None) -> tuple[str, str]:
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"calibration text {p} does not exist")
        return p.read_text(encoding="utf-8"), f"file:{p.name}"
    own = resolved.checkpoint.path / CALIB_TEXT
    if own.is_file():
        return own.read_text(encoding="utf-8"), text_origin(resolved.checkpoint.path, CALIB_TEXT)
    return corpus(DemoRecipe())["calib"], "builtin:python-stdlib-calibration"


def parse_dataset_spec(spec: str) -> tuple[str, str | None, str, str]:
    """``NAME:SPLIT``, ``NAME:CONFIG:SPLIT`` or ``NAME:CONFIG:SPLIT:COLUMN`` → (name, config, split, column)."""
    parts = spec.split(":")
    if len(parts) == 2:
        return parts[0], None, parts[1], "text"
    if len(parts) in (3, 4):
        return parts[0], parts[1] or None, parts[2], parts[3] if len(parts) == 4 else "text"
    raise ConfigError(f"invalid dataset spec {spec!r}: expected NAME:SPLIT or NAME:CONFIG:SPLIT[:COLUMN]",
                      hint="e.g. wikitext:wikitext-2-raw-v1:test")


def _dataset_text(spec: str) -> str:
    try:
        import datasets  # optional dependency
    except ImportError as exc:
        raise ConfigError("--eval-dataset needs the optional 'datasets' package",
                          hint="pip install datasets (and be online), or pass --eval-text FILE") from exc
    name, config, split, column = parse_dataset_spec(spec)
    ds = datasets.load_dataset(name, config, split=split)
    return "\n\n".join(str(t) for t in ds[column])


def ensure_window_set(settings: Settings, resolved: Resolved, spec: EvalSpec) -> tuple[Path, dict[str, Any], bool]:
    """The window set for this source and settings, from the registry or built and registered now.

    Returns (path to the npz in the blob store, its metadata, whether it was built now).
    """
    text, origin = eval_text(spec, resolved)
    fields: dict[str, Any] = {"text": hashlib.sha256(text.encode()).hexdigest(), "window": spec.window,
                               "stride": spec.stride, "max_windows": spec.max_windows}
    if spec.score_from != 1:  # only when set, so registries made before the option keep their keys
        fields["score_from"] = spec.score_from
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    reg = open_registry(settings)
    found = reg.find_source_artifact(resolved.source, "window_set", key)
    if found is not None:
        return reg.artifact_path(found), found.meta, False
    ws = build_window_set(resolved.checkpoint.path, text, window=spec.window, stride=spec.stride,
                          max_windows=spec.max_windows, score_from=spec.score_from)
    with scratch_dir(settings) as tmp:
        path = Path(tmp) / "windows.npz"
        ws.save(path)
        meta = {**ws.meta(), "origin": origin}
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
    with scratch_dir(settings) as tmp:
        out, summary = run_reference(resolved.checkpoint.path, windows, Path(tmp) / "ref", spec, settings)
        assert out.arrays is not None
        art = reg.put_source_artifact(model=resolved.model_name, architecture=resolved.architecture,
                                      source=resolved.source, kind="reference", key=key,
                                      name=f"reference-{key[:12]}.npz", path=out.arrays,
                                      meta={**summary, "window_set_id": ws_meta["id"]})
    return reg.artifact_path(art), art.meta, True


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
    for kind in ("tmp", "staging"):
        root = settings.work_root / kind
        if not root.is_dir():
            continue
        for entry in root.iterdir():
            pid = entry.name.split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    for partial in settings.work_root.glob("*/*/*.incomplete"):  # e.g. gguf-base/<key>/x.gguf.<pid>.incomplete
        pid = partial.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            partial.unlink(missing_ok=True)
            removed.append(partial)
    return removed


def has_quality_result(version: VersionView, engine: str, window_set_id: str) -> bool:
    return any(r.kind == "quality" and r.status == "ok" and r.engine == engine and r.window_set_id == window_set_id
               for r in version.results)


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
            outcome = evaluator.evaluate(model, windows=windows, window_set_id=str(ws_meta["id"]),
                                         reference=reference, spec=spec, out_dir=Path(tmp) / "eval",
                                         settings=settings)
        except QuantyardError as exc:
            reg.add_result(ref, {"kind": "quality", "engine": engine, "status": "failed",
                                 "window_set_id": ws_meta["id"], "error": _error_text(exc)})
            raise
    outcome.fallback = outcome.fallback or fallback
    for record in outcome.records():
        reg.add_result(version.ref, record)
    return outcome


def _error_text(exc: QuantyardError) -> str:
    tail = getattr(exc, "stderr_tail", "") or ""
    return exc.summary() + (f"\n--- stderr tail ---\n{tail[-2000:]}" if tail else "")


def model_path(fmt: str, files: list[Path], folder: Path) -> Path:
    """What an engine loads: the (first) GGUF file, or the folder for directory formats."""
    if fmt == "gguf":
        ggufs = sorted(f for f in files if f.suffix == ".gguf")
        return ggufs[0]
    return folder


def real_checkpoint(settings: Settings, recipe: RealRecipe | None = None) -> Path:
    """The real pretrained checkpoint (pipeline/real_model.py), built once and cached; its tokenizer is
    checked against llama.cpp's on the original GGUF, on the whole evaluation and calibration texts."""
    from converters.gguf import tool_env
    from converters.gguf_tokenizer import check_parity
    from pipeline.proc import failure_log_dir

    def parity(gguf: Path, checkpoint: Path, texts: dict[str, str], log_dir: Path) -> dict[str, Any]:
        return check_parity(gguf, checkpoint, python=settings.core_python, env=tool_env(), log_dir=log_dir,
                            timeout_s=600, allow=False, texts=texts, keep=failure_log_dir(settings.logs_root))

    recipe = recipe or RealRecipe()
    return cached_real_model(settings.cache_dir, settings.core_python, parity if recipe.fix_pretokenizer else None,
                             recipe)


def cleanup(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
