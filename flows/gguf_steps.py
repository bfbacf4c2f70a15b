"""GGUF-specific steps: what goes into a GGUF build key beyond the spec, the importance-matrix
calibration, and registering the imatrix and its calibration text as artifacts of the source.

Plain functions like ``flows.steps`` (which calls them); they join the converter and the registry.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from converters.base import Prepared
from converters.gguf import ImatrixRequest, choose_base_type
from flows.steps import Resolved, calibration_text, make_converter
from pipeline.config import Settings
from pipeline.errors import NotFoundError
from pipeline.plan import GGUFOptions, Plan
from pipeline.specs import QuantFormat
from registry import open_registry


def calibration_file(plan: Plan, resolved: Resolved, settings: Settings) -> tuple[Path, str]:
    """The calibration text as a content-addressed file under the work dir, and where it came from.

    Raises ConfigError when ``--calibration FILE`` does not exist.
    """
    text, origin = calibration_text(resolved, plan.gguf.calibration.file)
    data = text.encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    path = settings.work_root / "calibration" / f"{digest}.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.incomplete")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path, origin


def build_inputs(plan: Plan, resolved: Resolved, spec: Any, settings: Settings) -> dict[str, Any]:
    """Inputs besides the spec that change a GGUF variant's bytes (part of its build key): a forced
    base type, the split size, and for imatrix quants the calibration text, chunks and context."""
    if spec.format != QuantFormat.GGUF:
        return {}
    out: dict[str, Any] = {}
    if plan.gguf.base_type != "auto":
        out["base_type"] = plan.gguf.base_type
    if plan.gguf.split_max_size:
        out["split_max_size"] = plan.gguf.split_max_size
    if spec.imatrix:
        path, _ = calibration_file(plan, resolved, settings)
        out["imatrix"] = {"calibration_sha256": path.stem, "chunks": plan.gguf.calibration.chunks,
                          "context": plan.gguf.calibration.context}
    return out


def imatrix_request(plan: Plan, resolved: Resolved, settings: Settings) -> ImatrixRequest:
    """The calibration for this run; points at the registry's copy of the imatrix when one exists, so
    a cleaned work dir costs no recomputation."""
    path, origin = calibration_file(plan, resolved, settings)
    request = ImatrixRequest(calibration=path, origin=origin, chunks=plan.gguf.calibration.chunks,
                             context=plan.gguf.calibration.context)
    base_type = choose_base_type(resolved.checkpoint, plan.gguf.base_type)
    key = make_converter("gguf", plan, settings, imatrix=request).imatrix_key(base_type)
    reg = open_registry(settings)
    found = reg.find_source_artifact(resolved.source, "imatrix", key)
    return request if found is None else replace(request, existing=reg.artifact_path(found))


def register_imatrix(settings: Settings, resolved: Resolved, prepared: Prepared, stem: str) -> None:
    """Register the imatrix and its calibration text as artifacts of the source (idempotent)."""
    meta = prepared.meta.get("imatrix")
    if not meta:
        return
    reg = open_registry(settings)
    common = {"model": resolved.model_name, "architecture": resolved.architecture, "source": resolved.source}
    calib = Path(prepared.paths["calibration"])
    reg.put_source_artifact(**common, kind="calibration", key=meta["calibration_sha256"],
                            name=f"{stem}-calibration-{meta['calibration_sha256'][:12]}.txt", path=calib,
                            meta={"sha256": meta["calibration_sha256"], "origin": meta["calibration_origin"],
                                  "bytes": meta["calibration_bytes"]})
    reg.put_source_artifact(**common, kind="imatrix", key=meta["key"],
                            name=f"{stem}-imatrix-{meta['key'][:12]}.gguf", path=Path(prepared.paths["imatrix"]),
                            meta={**meta, "base_type": prepared.meta["base_type"]})


def recorded_options(lineage: dict[str, Any], resolved: Resolved, settings: Settings, work: Path) -> GGUFOptions:
    """The GGUF options a registered variant was built with, for rebuilding it: ``lineage["options"]``
    (versions registered before it was recorded: what ``lineage["parameters"]`` shows). The imatrix
    calibration text is the registry's copy (by its sha256), so a rebuild needs no file of the first machine.

    Raises NotFoundError when the calibration text is no longer in the registry.
    """
    params = lineage.get("parameters") or {}
    options = dict(lineage.get("options") or {})
    if not options:
        split = params.get("split") or {}
        options = {"base_type": params.get("base_type", "auto"), "split_max_size": split.get("max_size")}
    imatrix = params.get("imatrix")
    if imatrix:
        digest = imatrix["calibration_sha256"]
        art = open_registry(settings).find_source_artifact(resolved.source, "calibration", digest)
        if art is None:
            raise NotFoundError(f"the imatrix calibration text (sha256 {digest[:16]}…) recorded in the lineage "
                                    "is not in the registry", hint="register the variant again to store it")
        text = work / f"calibration-{digest[:16]}.txt"
        text.write_bytes(open_registry(settings).artifact_path(art).read_bytes())
        calibration = {**(options.get("calibration") or {}), "file": str(text), "chunks": imatrix.get(
            "chunks_requested"), "context": imatrix.get("context", 512)}
        options["calibration"] = calibration
    return GGUFOptions.model_validate(options)
