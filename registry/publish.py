"""Publish registry versions to the Hugging Face Hub, following each format's conventions.

* **GGUF**: one repo per model, one file per quant type at the root (``model-Q4_K_M.gguf``). A file
  larger than the split size is cut with llama.cpp's ``llama-gguf-split`` into
  ``TYPE/model-TYPE-0000k-of-0000n.gguf`` (the layout llama.cpp loads from the first part).
* **AWQ**: the checkpoint directory at the repo root (one repo per AWQ variant).
* **EXL2**: one branch per bits-per-weight (``4.0bpw``), each holding the directory; ``main``
  holds the card.

Every file is first copied out of the registry with its sha256 verified while streaming, so a
corrupt blob is never uploaded. ``dry_run`` writes the exact commit operations (with each file's
sha256 and size), the staged files and the card to a folder and touches no network.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi

from pipeline.errors import ConversionError, IllegalTransitionError, InvalidSpecError, ToolchainMissingError
from pipeline.formats import format_info, parse_variant_spec
from pipeline.llama_cpp import LlamaCppToolchain
from pipeline.shown import NOISE_FLOOR_KIND
from pipeline.specs import Ref, VersionState
from registry.blobs import sha256_file
from registry.card import build_card
from registry.store import Registry
from registry.views import VersionView

DEFAULT_SPLIT_MB = 48_000  # the Hub refuses files over 50 GB
PUBLISHABLE = (VersionState.VALIDATED.value, VersionState.PUBLISHED.value)


@dataclass(frozen=True)
class GGUFSplitter:
    """How to run llama.cpp's ``llama-gguf-split``: the llama.cpp of this machine (pipeline/llama_cpp.py)."""

    toolchain: LlamaCppToolchain

    def split(self, src: Path, out_prefix: Path, max_mb: int) -> list[Path]:
        """Raises ToolchainMissingError when llama-gguf-split is not installed, ConversionError when it fails."""
        binary = self.toolchain.exe("llama-gguf-split")
        out_prefix.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(binary), "--split", "--split-max-size", f"{max_mb}M", str(src), str(out_prefix)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=self.toolchain.env(), timeout=24 * 3600)
        parts = sorted(out_prefix.parent.glob(f"{out_prefix.name}-*-of-*.gguf"))
        if res.returncode != 0 or not parts:
            raise ConversionError(f"llama-gguf-split failed on {src.name} (exit {res.returncode})",
                                  stderr_tail=(res.stdout + res.stderr)[-3000:])
        return parts


@dataclass
class PublishRequest:
    refs: list[str]
    repo_id: str
    private: bool = False
    dry_run: bool = False
    out_dir: Path | None = None  # where a dry run writes its plan (required for dry runs)
    base_model: str | None = None  # hub id of the unquantized model (default: the source's repo id)
    split_mb: int = DEFAULT_SPLIT_MB
    splitter: GGUFSplitter | None = None
    token: str | None = None
    by: str | None = None


@dataclass
class PublishResult:
    repo_id: str
    operations: list[dict[str, Any]]
    card: str
    dry_run: bool
    out_dir: Path | None = None
    commits: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _views(reg: Registry, refs: list[str]) -> list[VersionView]:
    views = [reg.get_version(Ref.parse(r)) for r in refs]
    if not views:
        raise InvalidSpecError("nothing to publish: give at least one MODEL/VARIANT[@VERSION] reference")
    if len({v.model for v in views}) > 1 or len({v.format for v in views}) > 1:
        raise InvalidSpecError("one publication holds one model in one format; got "
                               + ", ".join(f"{v.ref} ({v.format})" for v in views),
                               hint="publish each model/format to its own repo")
    info = format_info(views[0].format)
    if info.hub.one_variant_per_repo and len(views) > 1:
        raise InvalidSpecError(f"an {info.label} repo holds one checkpoint directory: publish one {info.label} "
                               "variant per repo")
    return views


def _revision(view: VersionView) -> str | None:
    """The branch a variant goes to, for formats published one variant per revision (EXL2: ``4.0bpw``)."""
    if not format_info(view.format).hub.revision_per_variant:
        return None
    return str(parse_variant_spec({**view.spec, "format": view.format}).hub_revision)


def _stage_version(reg: Registry, view: VersionView, stage: Path, req: PublishRequest) -> list[dict[str, Any]]:
    """Copy a version's files (verified) into ``stage`` in the repo layout; returns operations."""
    revision = _revision(view)
    root = stage / (revision or "main")
    ops = []
    for f in view.files:
        dest = root / f.name
        reg.blobs.export(f.sha256, f.size, dest)
        paths = [(f.name, dest, "file")]
        if format_info(view.format).hub.split_large_files and f.size > req.split_mb * 1_000_000:
            if req.splitter is None:
                raise ToolchainMissingError(f"{f.name} is {f.size / 1e9:.1f} GB, over the split size, and no "
                                            "llama-gguf-split was given")
            parts = req.splitter.split(dest, root / view.variant / Path(f.name).stem, req.split_mb)
            dest.unlink()
            paths = [(f"{view.variant}/{p.name}", p, "split-part") for p in parts]
        for in_repo, path, kind in paths:
            ops.append({"path_in_repo": in_repo, "local_path": str(path), "revision": revision, "kind": kind,
                        "variant": view.variant, "ref": view.ref, "size": path.stat().st_size,
                        "sha256": f.sha256 if kind == "file" else sha256_file(path)})
    return ops


def _stage_inputs(reg: Registry, views: list[VersionView], stage: Path) -> tuple[list[dict[str, Any]],
                                                                                  list[dict[str, Any]]]:
    """Calibration data and imatrix files the versions used: uploaded when the registry holds them."""
    ops: list[dict[str, Any]] = []
    listed: list[dict[str, Any]] = []
    seen: set[str] = set()
    for v in views:
        for i in v.inputs:
            if i.kind not in ("calibration", "imatrix") or i.ref in seen:
                continue
            seen.add(i.ref)
            row = {"kind": i.kind, "name": i.name or i.ref, "ref": i.ref, "path": None}
            size = i.meta.get("size")
            if i.sha256 and isinstance(size, int) and reg.blobs.exists(i.sha256):
                in_repo = f"{i.kind}/{i.name or i.sha256}"
                dest = stage / "main" / in_repo
                reg.blobs.export(i.sha256, size, dest)
                ops.append({"path_in_repo": in_repo, "local_path": str(dest), "revision": None, "kind": i.kind,
                            "variant": v.variant, "ref": v.ref, "size": size, "sha256": i.sha256})
                row["path"] = in_repo
            listed.append(row)
    return ops, listed


def _card_files(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"variant": o["variant"], "kind": o["kind"], "size": f"{o['size'] / 1e6:,.2f} MB",
             "sha256": o["sha256"][:16] + "…",
             "path": (f"{o['revision']}:" if o["revision"] else "") + o["path_in_repo"]} for o in ops]


def plan_publication(reg: Registry, req: PublishRequest, stage: Path) -> PublishResult:
    """Stage files and build the card and the commit operations, without any network."""
    views = _views(reg, req.refs)
    ops: list[dict[str, Any]] = []
    for v in views:
        ops += _stage_version(reg, v, stage, req)
    input_ops, inputs = _stage_inputs(reg, views, stage)
    ops += input_ops
    src = views[0].source["identity"]
    card = build_card(views, repo_id=req.repo_id, base_model=req.base_model or views[0].source.get("repo_id"),
                      files=_card_files(ops), inputs=inputs,
                      window_sets=reg.list_source_artifacts(src, "window_set"),
                      references=reg.list_source_artifacts(src, "reference"),
                      noise_floors=reg.list_source_artifacts(src, NOISE_FLOOR_KIND))
    card_path = stage / "main" / "README.md"
    card_path.parent.mkdir(parents=True, exist_ok=True)
    card.save(card_path)
    text = card_path.read_text()
    ops.append({"path_in_repo": "README.md", "local_path": str(card_path), "revision": None, "kind": "card",
                "variant": None, "ref": None, "size": len(text.encode()),
                "sha256": hashlib.sha256(text.encode()).hexdigest()})
    warnings = [f"{v.ref} is {v.state}: a real publish needs it validated (quantyard state set {v.ref} validated)"
                for v in views if v.state not in PUBLISHABLE]
    return PublishResult(repo_id=req.repo_id, operations=ops, card=text, dry_run=req.dry_run, warnings=warnings)


def publish(reg: Registry, req: PublishRequest) -> PublishResult:
    """Publish ``req.refs`` to ``req.repo_id`` (or, with ``dry_run``, write the plan to ``req.out_dir``).

    A real publish needs every version ``validated`` (or already ``published``), uploads one commit per
    revision, then marks the versions ``published`` with the commit URL in the audit log.

    Raises:
        IllegalTransitionError: a version is not validated (real publish only).
        IntegrityError: a blob does not match its sha256 (nothing is uploaded).
    """
    if req.dry_run:
        if req.out_dir is None:
            raise InvalidSpecError("a dry run needs an output folder")
        if req.out_dir.exists():
            shutil.rmtree(req.out_dir)
        result = plan_publication(reg, req, req.out_dir / "files")
        result.out_dir = req.out_dir
        (req.out_dir / "operations.json").write_text(json.dumps(
            {"repo_id": req.repo_id, "repo_type": "model", "private": req.private,
             "commit_message": _message(req), "operations": result.operations, "warnings": result.warnings},
            indent=2))
        (req.out_dir / "README.md").write_text(result.card)
        return result
    views = _views(reg, req.refs)
    bad = [v.ref for v in views if v.state not in PUBLISHABLE]
    if bad:
        raise IllegalTransitionError(f"only validated versions can be published; not validated: {', '.join(bad)}",
                                     hint="validate them first: quantyard state set REF validated")
    with tempfile.TemporaryDirectory(prefix="quantyard-publish-") as tmp:
        result = plan_publication(reg, req, Path(tmp))
        result.commits = _upload(req, result.operations)
    for v in views:
        if v.state != VersionState.PUBLISHED.value:
            reg.set_state(v.ref, VersionState.PUBLISHED, by=req.by, note=f"published to {', '.join(result.commits)}")
    return result


def _message(req: PublishRequest) -> str:
    return f"Quantyard: publish {', '.join(req.refs)}"


def _upload(req: PublishRequest, ops: list[dict[str, Any]]) -> list[str]:
    api = HfApi(token=req.token)
    api.create_repo(req.repo_id, private=req.private, exist_ok=True, repo_type="model")
    by_revision: dict[str | None, list[dict[str, Any]]] = {}
    for op in ops:
        by_revision.setdefault(op["revision"], []).append(op)
    urls = []
    for revision, group in by_revision.items():
        if revision is not None:
            api.create_branch(req.repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(req.repo_id, operations=[
            CommitOperationAdd(path_in_repo=o["path_in_repo"], path_or_fileobj=o["local_path"]) for o in group],
            commit_message=_message(req), revision=revision)
        urls.append(str(info.commit_url))
    return urls
