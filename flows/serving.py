"""Serve one registered version behind its engine's OpenAI-compatible server, load it, register the result.

:func:`serve_version` is the serving stage's work (``quantyard serve-bench``, and the ``serve`` stage of a run
with ``--serving``): link the version's files, start its format's engine server (evaluators/serving/server.py:
health-checked, stopped after, never outliving a killed run), drive GuideLLM through the load profile
(evaluators/serving/load.py), and register one ``serving`` result (pipeline/serving.py) with the server's
flags, the profile, every level's latency distribution and the memory measured. The raw per-request logs go
into the registry as a source artifact (``serving_log``, gzip JSON), named by digest in the result, so that
listings stay small and every number can be recomputed from the timestamps.

Where the engine cannot run here (ExLlamaV2 without CUDA), a failed result says so; nothing is measured in
its place.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

from evaluators.serving.load import cpu_profile, profile_slo, run_load, seed_profile, sweep_profile, sweep_rates
from evaluators.serving.metrics import find_knee
from evaluators.serving.server import start_server
from evaluators.serving.spec import ServerSpec
from flows import steps
from pipeline.config import Settings
from pipeline.envs import detect_accelerator
from pipeline.errors import ConfigError, QuantyardError
from pipeline.formats import format_info
from pipeline.plan import ServingSpec
from pipeline.results import EvalResult
from pipeline.serving import LevelStats, LoadProfile, ServingMetrics
from pipeline.specs import SourceRef
from registry import open_registry
from registry.store import Registry, VersionView

#: Tokens a request may hold beyond prompt + output (the chat template's and the server's own few).
CONTEXT_MARGIN = 64


def profile_for(spec: ServingSpec, accelerator: str) -> LoadProfile:
    """The closed-loop profile: the seed shape (512/256 at 1/8/32/64 users) on a GPU, the CPU-scaled one on a
    CPU unless ``spec.profile`` says ``seed``; ``spec.users`` and ``spec.requests`` narrow it, recorded."""
    if spec.profile == "seed" or (spec.profile == "auto" and accelerator == "cuda"):
        base = seed_profile()
    else:
        base = cpu_profile()
    update: dict[str, Any] = {}
    if spec.users:
        update["concurrencies"] = sorted(spec.users)
    if spec.requests is not None:
        update["requests_per_level"] = spec.requests
        update["warmup_requests"] = min(base.warmup_requests, max(1, spec.requests // 4))
    if spec.prompt_tokens is not None or spec.output_tokens is not None:
        update["prompt_tokens"] = spec.prompt_tokens or base.prompt_tokens
        update["output_tokens"] = spec.output_tokens or base.output_tokens
    if update and base.name == "seed":
        update["name"] = "custom"
    profile = base.model_copy(update=update)
    if update:
        asked = ", ".join(f"{k}={v}" for k, v in update.items() if k != "name")
        profile = profile.model_copy(update={"note": "; ".join(x for x in (profile.note, f"asked: {asked}") if x)})
    return profile


def _tokenizer_dir(version: VersionView, model: Path, spec: ServingSpec) -> Path:
    """Where GuideLLM's tokenizer comes from: ``spec.tokenizer``, a folder variant's own files, else the
    version's local source folder.

    Raises:
        ConfigError: none of them holds a tokenizer.
    """
    candidates = [Path(spec.tokenizer)] if spec.tokenizer else []
    if model.is_dir():
        candidates.append(model)
    if version.source.get("path"):
        candidates.append(Path(str(version.source["path"])))
    for folder in candidates:
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            return folder
    raise ConfigError(f"no tokenizer for {version.ref}'s load prompts (looked in {', '.join(map(str, candidates))})",
                      hint="pass --tokenizer with the source checkpoint's folder")


def serve_version(settings: Settings, ref: str, spec: ServingSpec, work: Path) -> EvalResult:
    """Serve ``ref`` on its format's engine, load it, and register the serving result (see the module doc).

    Raises:
        EngineError: the server or the load generator failed (a failed result is registered first).
        ToolchainMissingError: the engine or GuideLLM cannot run here (a failed result says so).
        ConfigError: no tokenizer for the prompts.
    """
    reg = open_registry(settings)
    version = reg.get_version(ref)
    engine = str(format_info(version.format).engine)
    try:
        result = _measure(settings, reg, version, engine, spec, work)
    except QuantyardError as exc:
        reg.add_result(version.ref, {"kind": "serving", "engine": engine, "status": "failed",
                                     "error": f"{type(exc).__name__}: {exc.summary()}"})
        raise
    reg.add_result(version.ref, result)
    return result


def _measure(settings: Settings, reg: Registry, version: VersionView, engine: str, spec: ServingSpec,
             work: Path) -> EvalResult:
    files = reg.link_files(version.ref, work / "model")
    model = steps.model_path(version.format, files, work / "model")
    tokenizer = _tokenizer_dir(version, model, spec)
    profile = profile_for(spec, detect_accelerator(settings))
    slots = max([*profile.concurrencies, 1])
    server_spec = ServerSpec(engine=engine, model=model, slots=slots,  # type: ignore[arg-type]  # an Engine value
                             context=profile.prompt_tokens + profile.output_tokens + CONTEXT_MARGIN,
                             tensor_parallel=spec.tensor_parallel)
    with start_server(server_spec, settings, work / "logs") as server:
        levels = run_load(server.base_url, server.model_name, tokenizer, profile, settings, work / "load",
                          sampler=server)
        knee = None
        if spec.sweep:
            sweep = sweep_profile(sweep_rates(levels), shape=profile)
            swept = run_load(server.base_url, server.model_name, tokenizer, sweep, settings, work / "sweep",
                             sampler=server)
            knee = _knee(swept, sweep)
            levels = [*levels, *swept]
        memory = server.memory_info(concurrency=slots)
        info = server.info
    log = _store_logs(reg, version, levels, work)
    metrics = ServingMetrics(server=info, profile=profile, levels=[lv.model_copy(update={"requests_log": []})
                                                                   for lv in levels],
                             memory=memory, knee=knee, requests_log_artifact=log).model_dump(mode="json")
    return EvalResult(kind="serving", engine=engine, engine_version=info.version, metrics=metrics,
                      hardware=_hardware(settings))


def _knee(swept: list[LevelStats], sweep: LoadProfile) -> dict[str, Any] | None:
    slo = profile_slo(sweep)
    return None if slo is None else find_knee(swept, slo)


def _store_logs(reg: Registry, version: VersionView, levels: list[LevelStats], work: Path) -> dict[str, Any]:
    """The per-request logs of every level, gzip JSON, as a ``serving_log`` artifact of the version's source;
    returns its reference (kind, key, sha256, size) for the result."""
    payload = json.dumps({"version": version.ref, "levels": [lv.model_dump(mode="json") for lv in levels]},
                         sort_keys=True).encode()
    key = hashlib.sha256(payload).hexdigest()
    path = work / f"serving-log-{key[:12]}.json.gz"
    path.write_bytes(gzip.compress(payload, mtime=0))
    source = SourceRef.model_validate({k: v for k, v in version.source.items() if k in SourceRef.model_fields})
    art = reg.put_source_artifact(model=version.model, architecture=version.architecture, source=source,
                                  kind="serving_log", key=key, name=path.name, path=path,
                                  meta={"version": version.ref, "levels": len(levels)})
    return {"kind": "serving_log", "key": key, "sha256": art.sha256, "size": art.size}


def _hardware(settings: Settings) -> dict[str, Any]:
    from evaluators.protocol import hardware

    return hardware(settings.threads)
