"""``quantyard validate``: named CI gates for one quant.

Checks, in order (each passes, fails, or is skipped with a reason):
integrity → format → loadability → tokenizer_parity → quality → speed (with --baseline) → serving (with a
serving SLO in the policy: flows/serving_gate.py) → reproducibility (opt-in). A target is a registry reference
or a plain GGUF file / AWQ folder / EXL2 folder with a declared source (``--source``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from converters.lookup import converter_class
from evaluators.reference import reference_key
from evaluators.speed import comparable
from flows import steps
from flows.preflight import settle_eval
from flows.serving_gate import check_serving
from pipeline import workdir
from pipeline.checks import CheckFailed, CheckSkipped, ValidationReport
from pipeline.config import Settings
from pipeline.errors import (
    ConversionError,
    IntegrityError,
    InvalidArtifactError,
    InvalidSpecError,
    NotFoundError,
    QuantyardError,
    TokenizerMismatchError,
)
from pipeline.formats import FORMATS, format_info, parse_variant_spec
from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec
from pipeline.policy import Policy, quant_class
from pipeline.specs import Ref, VersionState
from pipeline.texts import BUILTIN_EVAL_ORIGIN
from registry import open_registry
from registry.blobs import sha256_file
from registry.store import VersionView
from registry.views import ResultView


@dataclass
class Target:
    label: str
    fmt: str
    variant: str
    spec: dict[str, Any]
    files: list[Path]
    model_path: Path
    version: VersionView | None = None
    source_text: str | None = None  # how to resolve the source (path or hub id)
    source_revision: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class ValidateOptions:
    policy: Policy
    source: str | None = None
    baseline: str | None = None
    reproduce: bool = False
    #: How to evaluate; None: a registry target as it was registered (:func:`recorded_eval`), a plain file
    #: with the defaults (:data:`DEFAULT_EVAL`).
    eval: EvalSpec | None = None

    @property
    def spec(self) -> EvalSpec:
        return self.eval or DEFAULT_EVAL


DEFAULT_EVAL = EvalSpec(speed=SpeedSpec(enabled=False))


def recorded_eval(version: VersionView, settings: Settings, base: EvalSpec) -> EvalSpec:
    """``base`` cut into windows as ``version``'s newest quality result was (window, stride, scored positions,
    number of windows, from its window set's record), so that validating a registered version without
    evaluation options checks, and can reuse, the evaluation it was registered with; ``base`` when it has none.
    The KLD mode and top-K stay ``base``'s (a result in another mode is not reused); where ``base`` leaves the
    reference engine to the automatic choice, the result's own reference (engine, dtype, device) is taken."""
    sets = {a.meta.get("id"): a.meta for a in open_registry(settings).list_source_artifacts(
        str(version.source["identity"]), "window_set")}
    refs = {a.key: a.meta for a in open_registry(settings).list_source_artifacts(
        str(version.source["identity"]), "reference")}
    for r in reversed(version.results):
        meta = sets.get(r.window_set_id) if r.kind == "quality" and r.status == "ok" else None
        if meta is None:
            continue
        max_windows = meta["max_windows"] if "max_windows" in meta else meta.get("n_windows")
        update: dict[str, Any] = {"window": int(meta["window"]), "stride": int(meta["stride"]),
                                  "score_from": int(meta.get("score_from", 1)), "max_windows": max_windows}
        ref = refs.get(str(r.metrics.get("reference_key")))
        if not base.settled and ref is not None and ref.get("engine"):  # the reference it was registered against
            update.update({"reference_engine": ref["engine"], "reference_dtype": ref.get("dtype"),
                           "reference_device": ref.get("device") or "cpu",
                           "reference_reason": "the reference this version was registered against"})
        return base.model_copy(update=update)
    return base


def detect_format(path: Path) -> str:
    """The format of a plain target: a single-file format by its magic bytes or suffix, a folder by its
    ``quantization_config.quant_method`` (or the single-file parts it holds).

    Raises InvalidSpecError when no format in FORMATS claims it.
    """
    singles = [i for i in FORMATS.values() if i.single_file]
    if path.is_file():
        with path.open("rb") as fh:
            head = fh.read(16)
        for info in singles:
            if (info.magic and head.startswith(info.magic)) or path.suffix == info.suffix:
                return str(info.format)
        raise InvalidSpecError(f"{path} is neither a {' or '.join(i.label for i in singles)} file nor a folder",
                               hint="pass a quantized file or folder, or a registry reference")
    cfg = path / "config.json"
    if path.is_dir() and cfg.is_file():
        method = (json.loads(cfg.read_text()).get("quantization_config") or {}).get("quant_method")
        for info in FORMATS.values():
            if method in info.quant_methods:
                return str(info.format)
        known = sorted(m for i in FORMATS.values() for m in i.quant_methods)
        raise InvalidSpecError(f"{path} has quant_method {method!r}; expected one of {', '.join(known)}")
    for info in singles:
        if path.is_dir() and sorted(path.glob(f"*{info.suffix}")):
            return str(info.format)
    raise InvalidSpecError(f"cannot tell the format of {path}", hint="expected a quantized file or folder")


def check_structure(fmt: str, path: Path) -> None:
    """A plain target that cannot even be read as its format is bad input (exit 2), not a failed check."""
    cls = converter_class(fmt)
    if hasattr(cls, "read_structure"):
        cls.read_structure(path)


def split_source(text: str | None) -> tuple[str | None, str | None]:
    """``OWNER/NAME@REVISION`` → (hub id, revision); a path or a bare id → (text, None)."""
    if not text or Path(text).expanduser().exists() or "@" not in text:
        return text, None
    repo, _, revision = text.partition("@")
    return repo, revision or None


def resolve_target(text: str, settings: Settings, opts: ValidateOptions, work: Path) -> Target:
    path = Path(text).expanduser()
    if path.exists():
        fmt = detect_format(path)
        check_structure(fmt, path)
        variant, spec = converter_class(fmt).describe(path)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        model = path if path.is_file() else steps.model_path(fmt, files, path)
        source, revision = split_source(opts.source)
        return Target(label=path.name, fmt=fmt, variant=variant, spec=spec, files=files, model_path=model,
                      source_text=source, source_revision=revision)
    ref = Ref.parse(text)
    reg = open_registry(settings, create=False)
    view = reg.get_version(ref)
    files = reg.link_files(view.ref, work / "files")
    src = view.source
    source_text = opts.source or (src.get("repo_id") if src.get("kind") == "hub" else src.get("path"))
    return Target(label=view.ref, fmt=view.format, variant=view.variant, spec=view.spec, files=files,
                  model_path=steps.model_path(view.format, files, work / "files"), version=view,
                  source_text=source_text, source_revision=src.get("commit"))


# --- checks -------------------------------------------------------------------------------------


def check_integrity(target: Target, settings: Settings) -> tuple[str, dict[str, Any]]:
    if target.version is None:
        digests = {p.name: sha256_file(p) for p in target.files}
        empty = [p.name for p in target.files if p.stat().st_size == 0]
        if empty:
            raise CheckFailed(f"empty files: {', '.join(empty)}")
        return f"{len(digests)} files hashed (no registry record to compare with)", {"sha256": digests}
    bad = []
    reg = open_registry(settings)
    for f in target.version.files:
        try:  # the store's own file, or a verified local copy of a remote store's object
            blob = reg.local_blob(f.sha256, f.size)
        except (NotFoundError, IntegrityError) as exc:
            bad.append(f"{f.name}: {exc.message}")
            continue
        size, digest = blob.stat().st_size, sha256_file(blob)
        if size != f.size or digest != f.sha256:
            bad.append(f"{f.name}: expected {f.size} B sha256 {f.sha256[:16]}…, found {size} B {digest[:16]}…")
    if bad:
        raise CheckFailed("; ".join(bad))
    return f"{len(target.version.files)} files match their sha256 and size", {}


def check_format(target: Target) -> tuple[str, dict[str, Any]]:
    cls = converter_class(target.fmt)
    if not hasattr(cls, "sanity"):
        raise CheckSkipped(f"no format checker for {target.fmt} yet")
    try:
        message, summary = cls.sanity(target.model_path, target.files)
    except (InvalidArtifactError, ConversionError) as exc:
        raise CheckFailed(exc.message, hint=exc.hint or "") from exc
    return str(message), dict(summary)


def _engine_for(fmt: str, settings: Settings) -> tuple[Any, str | None]:
    """The evaluator for a format, or its reference stand-in with the reason, when the engine is unavailable."""
    from evaluators.engines import get_evaluator

    info = format_info(fmt)
    evaluator = get_evaluator(info.engine)
    reason = evaluator.unavailable_reason(settings)
    if reason is None:
        return evaluator, None
    if info.fallback_engine is None:
        raise CheckFailed(f"{info.engine} is unavailable here ({reason}) and {fmt} has no reference engine")
    return get_evaluator(info.fallback_engine), f"{info.engine} unavailable ({reason}); used {info.fallback_engine}"


def check_loadability(target: Target, settings: Settings, work: Path) -> tuple[str, dict[str, Any]]:
    evaluator, fallback = _engine_for(target.fmt, settings)
    try:
        info = evaluator.probe(target.model_path, out_dir=work / "probe", settings=settings)
    except QuantyardError as exc:
        raise CheckFailed(f"{evaluator.engine.value} could not load it: {exc.message}",
                          stderr_tail=getattr(exc, "stderr_tail", "")[-1500:]) from exc
    target.notes["fallback"] = fallback
    target.notes["engine"] = evaluator.engine.value  # results of this engine are reused by the quality check
    msg = f"loads in {evaluator.engine.value} ({info.get('engine_version')})"
    return (msg + f" — fallback: {fallback}" if fallback else msg), {**info, "fallback": fallback}


def _source_for(target: Target, settings: Settings) -> steps.Resolved:
    cached = target.notes.get("resolved")
    if cached is not None:
        return cached
    if not target.source_text:
        raise InvalidSpecError(f"{target.label} has no declared source to evaluate against",
                               hint="pass --source CHECKPOINT_FOLDER_OR_HUB_ID")
    plan = Plan(source=SourceInput(source=target.source_text, revision=target.source_revision),
                variants=(), eval=EvalSpec())
    src = steps.resolve_source(plan.source.source, revision=plan.source.revision, cache_dir=settings.cache_dir,
                               hub=steps.hub_options(settings))
    ckpt = steps.load_checkpoint(Path(src.path), allowed_roots=steps.allowed_roots(src))
    resolved = steps.Resolved(source=src, model_name=steps.default_model_name(src), checkpoint=ckpt)
    target.notes["resolved"] = resolved
    return resolved


def reusable_result(version: VersionView, engines: tuple[str | None, ...], settings: Settings,
                    spec: EvalSpec) -> ResultView | None:
    """The newest ok quality result of ``version`` on one of ``engines`` that ``spec`` would reproduce: its window
    set was cut from the source's default evaluation text exactly as ``spec`` cuts it (the window set's registry
    key, recomputed from its recorded text sha256) and it was scored against the reference ``spec`` asks for (the
    reference key: engine, dtype, top-K and storage, hence the KLD mode). Anything else is evaluated again."""
    sets = {a.meta.get("id"): a for a in open_registry(settings).list_source_artifacts(
        str(version.source["identity"]), "window_set")}
    for r in reversed(version.results):
        if r.kind != "quality" or r.status != "ok" or r.engine not in engines:
            continue
        ws = sets.get(r.window_set_id)
        if ws is None or not str(ws.meta.get("origin", "")).startswith(DEFAULT_TEXT_ORIGINS):
            continue
        if ws.key != steps.window_set_key(str(ws.meta.get("text_sha256")), spec):
            continue
        if r.metrics.get("reference_key") == reference_key(str(r.window_set_id), spec):
            return r
    return None


#: Origins of the evaluation text validate uses (it takes no --eval-text): the source's own, or the built-in.
DEFAULT_TEXT_ORIGINS = ("checkpoint:eval.txt", BUILTIN_EVAL_ORIGIN)


def _quality_metrics(target: Target, settings: Settings, opts: ValidateOptions, work: Path) -> dict[str, Any]:
    engine = str(format_info(target.fmt).engine)
    if target.version is not None and opts.eval is None:
        opts = replace(opts, eval=recorded_eval(target.version, settings, DEFAULT_EVAL))
    engines = (engine, target.notes.get("engine"))
    if target.version is not None and opts.spec.settled:
        r = reusable_result(target.version, engines, settings, opts.spec)
        if r is not None:
            return {**r.metrics, "window_set_id": r.window_set_id, "engine": r.engine, "reused": True}
    resolved = _source_for(target, settings)
    if target.version is not None:
        resolved.model_name = target.version.model
    if not opts.spec.settled:  # chosen for this machine as convert chooses it (flows/preflight.py)
        opts = replace(opts, eval=settle_eval(opts.spec, resolved.checkpoint.facts, settings))
        r = reusable_result(target.version, engines, settings, opts.spec) if target.version is not None else None
        if r is not None:  # the reference it chose is the one this version was evaluated against
            return {**r.metrics, "window_set_id": r.window_set_id, "engine": r.engine, "reused": True}
    steps.check_window_fits(opts.spec, resolved.checkpoint)  # as convert checks them (flows/steps.py)
    steps.check_eval_text(opts.spec, resolved.checkpoint)
    windows, ws_meta, _ = steps.ensure_window_set(settings, resolved, opts.spec)
    reference, _, _ = steps.ensure_reference(settings, resolved, windows, ws_meta, opts.spec)
    if target.version is not None:
        outcome = steps.evaluate_version(settings, target.version.ref, target.fmt, windows, ws_meta, reference,
                                         opts.spec)
    else:
        evaluator, _ = _engine_for(target.fmt, settings)
        outcome = evaluator.evaluate(target.model_path, windows=windows, window_set_id=str(ws_meta["id"]),
                                     reference=reference, spec=opts.spec, out_dir=work / "eval", settings=settings)
    return {**(outcome.quality or {}), "window_set_id": ws_meta["id"], "engine": outcome.engine, "reused": False}


def check_quality(target: Target, settings: Settings, opts: ValidateOptions, work: Path) -> tuple[str, dict[str, Any]]:
    cls = quant_class(target.fmt, target.spec)
    limits = opts.policy.limits_for(target.variant, cls, target.spec.get("type"))
    m = _quality_metrics(target, settings, opts, work)
    found: dict[str, Any] = {"kld_mean": m.get("kld_mean"), "kld_method": m.get("kld_method"),
                             "delta_ppl_pct": m.get("delta_ppl_pct"), "top1": m.get("top1_agreement"),
                             **{k: m.get(k) for k in ("kld_ci95_low", "kld_ci95_high", "delta_ppl_pct_ci95_low",
                                                      "delta_ppl_pct_ci95_high", "ci_method", "n_windows")}}
    problems = limits.problems(m)
    details = {"class": cls, "limits": limits.model_dump(), **found, "window_set_id": m.get("window_set_id"),
               "reference_key": m.get("reference_key"), "engine": m.get("engine"), "reused_result": m.get("reused"),
               "gates": limits.lines(m)}
    gates = "; ".join(details["gates"]) or "no limits set"
    if problems:
        raise CheckFailed(f"{target.variant} ({cls}) fails the quality policy: " + "; ".join(problems)
                          + f" — gates: {gates}", **details)
    return f"{cls}: {gates}", details


def _same_hardware(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """How two speed records' machines differ; the engine build's kernels (``llama_cpp_build``: AMX compiled in
    or not) count where both recorded them."""
    keys = ["cpu", "cores", "threads", "gpu", "machine", "cpu_flags"]
    if "llama_cpp_build" in a and "llama_cpp_build" in b:
        keys.append("llama_cpp_build")
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def _speed_of(target: Target, settings: Settings, opts: ValidateOptions, work: Path) -> tuple[dict, dict, str]:
    engine = str(format_info(target.fmt).engine)
    if target.version is not None:
        for r in reversed(target.version.results):
            if r.kind == "speed" and r.status == "ok" and r.engine == engine:
                return r.metrics, r.hardware, r.engine
    evaluator, fallback = _engine_for(target.fmt, settings)
    if fallback:
        raise CheckSkipped(f"speed needs the real engine: {fallback}")
    spec = EvalSpec(speed=opts.spec.speed.model_copy(update={"enabled": True}))
    speed, hardware, _ = evaluator.measure_speed(target.model_path, spec=spec, out_dir=work / "speed",
                                                  settings=settings)
    return speed, hardware, evaluator.engine.value


def check_speed(target: Target, settings: Settings, opts: ValidateOptions, work: Path) -> tuple[str, dict[str, Any]]:
    if not opts.baseline:
        raise CheckSkipped("no --baseline given")
    base = open_registry(settings, create=False).get_version(opts.baseline)
    base_speed = next((r for r in reversed(base.results) if r.kind == "speed" and r.status == "ok"), None)
    if base_speed is None:
        raise CheckSkipped(f"baseline {base.ref} has no speed result")
    speed, hardware, engine = _speed_of(target, settings, opts, work)
    if engine != base_speed.engine:
        raise CheckSkipped(f"baseline was measured on {base_speed.engine}, target on {engine}")
    differs = _same_hardware(base_speed.hardware, hardware)
    if differs:
        raise CheckSkipped("baseline was measured on different hardware (" + "; ".join(differs) + ")")
    unlike = comparable(base_speed.metrics, speed)
    if unlike:
        raise CheckSkipped("baseline was measured with other speed definitions or another shape ("
                           + "; ".join(unlike) + ")")
    limit = opts.policy.speed.max_slowdown_pct
    rows, problems = {}, []
    for metric in opts.policy.speed.metrics:
        new, old = _median(speed.get(metric)), _median(base_speed.metrics.get(metric))
        if new is None or old is None:
            continue
        change = 100.0 * (new / old - 1.0)
        rows[metric] = {"baseline": old, "target": new, "change_pct": round(change, 2)}
        if change < -limit:
            problems.append(f"{metric} {new:.1f} vs baseline {old:.1f} ({change:+.1f}% < -{limit}%)")
    if problems:
        raise CheckFailed("slower than the baseline: " + "; ".join(problems), **rows)
    return f"within {limit}% of {base.ref}", rows


def _median(x: Any) -> float | None:
    if isinstance(x, dict):
        return x.get("median")
    return float(x) if isinstance(x, int | float) else None


def check_reproducibility(target: Target, settings: Settings, work: Path) -> tuple[str, dict[str, Any]]:
    """Rebuild the version from its lineage (source, spec and the options it was built with) in an empty
    work dir, and compare the files bit for bit."""
    if target.version is None:
        raise CheckSkipped("reproducibility needs a registry version with recorded lineage")
    lineage = target.version.lineage
    fmt = target.fmt
    spec = parse_variant_spec(lineage["spec"])
    resolved = _source_for(target, settings)
    if resolved.source.identity != lineage["source"]["identity"]:
        raise CheckSkipped(f"source {resolved.source.identity} is not the recorded {lineage['source']['identity']}")
    plan = rebuild_plan(target, resolved, spec, settings, work)
    converter = steps.make_converter(fmt, plan, settings)
    if converter.tool_identity() != lineage.get("tool"):
        raise CheckSkipped(f"the installed toolchain differs from the one recorded: {converter.tool_identity()} vs "
                           f"{lineage.get('tool')}")
    resolved.model_name = target.version.model
    fresh = settings.model_copy(update={"work_dir": work / "rebuild-work"})  # no cached base: rebuild from scratch
    prepared = steps.prepare_format(fmt, plan, resolved, [spec], fresh)
    built = steps.build_variant(fmt, plan, resolved, prepared, spec, fresh, work / "rebuild")
    recorded = {f.name: f.sha256 for f in target.version.files}
    rebuilt = {name: sha256_file(path) for name, path in built.files.items()}
    if rebuilt != recorded:
        diff = {n: (recorded.get(n), rebuilt.get(n)) for n in set(recorded) | set(rebuilt)
                if recorded.get(n) != rebuilt.get(n)}
        raise CheckFailed(f"rebuild differs from the registered files: {sorted(diff)}", differences=diff)
    return f"rebuilt {len(rebuilt)} file(s) bit for bit", {"sha256": rebuilt, "events": prepared.events + built.events}


def rebuild_plan(target: Target, resolved: steps.Resolved, spec: Any, settings: Settings, work: Path) -> Plan:
    """The plan that builds ``spec`` exactly as the version was built: its format's options from the lineage."""
    assert target.version is not None
    lineage = target.version.lineage
    options: dict[str, Any] = {}
    field = format_info(target.fmt).plan_options
    if field is not None:
        reg = open_registry(settings)

        def artifact(kind: str, key: str) -> Path | None:
            found = reg.find_source_artifact(resolved.source, kind, key)
            return None if found is None else reg.artifact_path(found)

        try:
            options[field] = converter_class(target.fmt).recorded_options(lineage, artifact, work)
        except NotFoundError as exc:
            raise CheckSkipped(exc.message) from exc
    return Plan(source=SourceInput(source=target.source_text or ""), variants=(spec,), eval=EvalSpec(), **options)


# --- entry point ----------------------------------------------------------------------------------


def validate(target_text: str, settings: Settings, opts: ValidateOptions) -> ValidationReport:
    """Run every check on one target. Raises typed errors (exit 2) only for unusable input."""
    with workdir.lease(settings.work_root), steps.scratch_dir(settings) as tmp:
        work = Path(tmp)
        target = resolve_target(target_text, settings, opts, work)
        report = ValidationReport(target=target.label, context={"format": target.fmt, "variant": target.variant})
        report.run("integrity", lambda: check_integrity(target, settings))
        fmt_ok = report.run("format", lambda: check_format(target)).status != "fail"
        loads = fmt_ok and report.run("loadability", lambda: check_loadability(target, settings, work)).status == "pass"
        report.run("tokenizer_parity", lambda: check_tokenizer_parity(target, settings, work))
        if loads:
            report.run("quality", lambda: check_quality(target, settings, opts, work))
            report.run("speed", lambda: check_speed(target, settings, opts, work))
        else:
            for name in ("quality", "speed"):
                report.run(name, lambda: _skip("the variant did not load (see loadability)"))
        report.run("serving", lambda: check_serving(target.version, opts.policy.serving))  # a stored measurement
        if opts.reproduce:
            report.run("reproducibility", lambda: check_reproducibility(target, settings, work))
        else:
            report.run("reproducibility", lambda: _skip("opt-in: pass --reproduce"))
    return report


def _skip(reason: str) -> None:
    raise CheckSkipped(reason)


def check_tokenizer_parity(target: Target, settings: Settings, work: Path) -> tuple[str, dict[str, Any]]:
    """The engine's tokenization of the probe text must equal the source's HF tokenizer's (GGUF carries its
    own vocabulary and pre-tokenizer; AWQ and EXL2 folders load the HF tokenizer itself)."""
    if not format_info(target.fmt).own_tokenizer:
        raise CheckSkipped(f"{target.fmt} engines load the checkpoint's own HF tokenizer files")
    if not target.source_text:
        raise CheckSkipped("no declared source to compare the tokenizer with (pass --source)")
    try:
        resolved = _source_for(target, settings)
    except QuantyardError as exc:
        raise CheckSkipped(f"the source is not available here: {exc.message}") from exc
    log_dir = work / "tokenize"
    log_dir.mkdir(parents=True, exist_ok=True)
    texts: dict[str, str] = {}  # origin -> text: what the source is evaluated and calibrated on by default
    for text, origin in (steps.eval_text(EvalSpec(), resolved), steps.calibration_text(resolved)):
        texts.setdefault(origin, text)
    try:
        converter = steps.make_converter(target.fmt, Plan(source=SourceInput(source=target.source_text),
                                                          variants=()), settings)
        record = converter.tokenizer_parity(target.model_path, resolved.checkpoint.path, texts, log_dir)
    except TokenizerMismatchError as exc:
        raise CheckFailed(exc.message, position=exc.position, hf=exc.expected, gguf=exc.found) from exc
    n_text = sum(r["tokens_hf"] for label, r in record["texts"].items() if label != "probe")
    return (f"{record['tokens_hf']} probe tokens and {n_text} tokens of the source's evaluation and calibration "
            "texts identical to the HF tokenizer's", record)


def promote(report: ValidationReport, target_text: str, settings: Settings) -> str | None:
    """Move a passing registry target from candidate to validated; returns the new state or None."""
    if not report.passed or Path(target_text).exists():
        return None
    reg = open_registry(settings, create=False)
    view = reg.get_version(target_text)
    if view.state != VersionState.CANDIDATE.value:
        return view.state
    return reg.set_state(view.ref, VersionState.VALIDATED).state
