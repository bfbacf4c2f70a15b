"""The stage ledger: what every stage of a distributed run produced, under a key, in the registry.

A stage's key is the sha256 of (source identity — a hub commit or a folder's content hash —, the stage
and its spec, the lock hashes of the tool environments it runs, the Quantyard version). When a stage
finishes it records a :class:`StageRecord` under that key as a source artifact of kind ``stage``: a small
JSON blob whose metadata holds the stage's outputs, which are only registry references (``demo/Q8_0@1``)
and blob digests, never paths of the machine that ran it. An orchestrator that finds a stage's key in
the ledger (with its outputs still present) does not run the stage again: that is how a rerun does no
work and a crashed run resumes at its first unfinished stage.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from converters.checkpoint import HashCache, content_hash
from converters.source import HubOptions, hub_errors, looks_like_hub_id
from evaluators.engines import engine_info
from pipeline import __version__
from pipeline.config import Settings
from pipeline.envs import ENVS
from pipeline.errors import SourceNotFoundError, ToolchainMissingError, UnknownFormatError
from pipeline.formats import FORMATS, format_info
from pipeline.plan import SourceInput
from pipeline.proc import REPO_ROOT
from pipeline.progress import RESOLVE_PARTS, stage
from pipeline.specs import SourceKind, SourceRef
from registry.store import Registry

STAGE_KIND = "stage"
CORE_LOCK = "requirements/core.lock"

class StageRecord(BaseModel):
    """One finished stage: its key, where it ran, and its outputs (registry references and digests)."""

    stage: str  # e.g. "build:Q8_0"
    key: str
    pool: str | None = None
    outputs: dict[str, Any] = Field(default_factory=dict)
    work_s: float = 0.0  # time in the stage's own work (conversion, quantization, evaluation)
    wall_s: float = 0.0  # the stage flow's body, registry reads and writes included
    host: str = Field(default_factory=socket.gethostname)
    flow_run_id: str | None = None
    slot: str | None = None  # the concurrency limit the stage held, if any
    #: What the stage used (pipeline/resources.py Usage.as_dict: seconds, the peak of its own memory and of the
    #: machine's memory in use); None in records written before it was measured.
    usage: dict[str, Any] | None = None
    quantyard_version: str = __version__
    finished_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())


@cache
def _file_digest(rel: str) -> str:
    path = REPO_ROOT / rel
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ToolchainMissingError(f"the lock file {rel} is not under {REPO_ROOT} ({exc.strerror}): stage keys "
                                    "must depend on the exact tool versions it pins",
                                    hint="run distributed stages from a checkout of Quantyard (pip install -e .), "
                                         "where requirements/ is present") from exc


def _pins(tool: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(lock files, managed environments) that pin ``tool``: a format (its converter), an engine, or a managed
    environment by name (``guidellm``, the serving stage's load generator)."""
    if tool == "core":
        return (), ()
    if tool in ENVS and tool not in FORMATS:
        try:
            engine_info(tool)
        except UnknownFormatError:
            return (), (tool,)
    if tool in FORMATS:
        fmt = format_info(tool)
        return fmt.tool_locks, fmt.tool_envs
    engine = engine_info(tool)  # raises, listing the known engines, for anything else
    return engine.tool_locks, engine.tool_envs


def lock_hash(tool: str) -> str:
    """sha256 of the files that pin ``tool``'s environment: requirements/core.lock (the core environment
    runs every stage), plus the tool's own lock files and managed-environment requirement files
    (FormatInfo / EngineInfo). Raises ToolchainMissingError when a lock file is absent, UnknownFormatError
    for a tool that is neither a format nor an engine."""
    locks, envs = _pins(tool)
    parts = {CORE_LOCK: _file_digest(CORE_LOCK)}
    for rel in locks:
        parts[rel] = _file_digest(rel)
    for env in envs:
        spec = ENVS[env]
        for build in (spec.cpu, spec.cuda):
            if build is not None:
                rel = str(build.requirements.relative_to(REPO_ROOT))
                parts[rel] = _file_digest(rel)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def stage_key(source_identity: str, stage: str, spec: dict[str, Any], tools: Iterable[str] = ()) -> str:
    """The key of one stage's output (see the module docstring)."""
    body = {"source": source_identity, "stage": stage, "spec": spec,
            "locks": {t: lock_hash(t) for t in sorted(set(tools) | {"core"})}, "quantyard": __version__}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


class _Identity:
    """What ``Registry.find_source_artifact`` needs of a source: its identity."""

    def __init__(self, identity: str) -> None:
        self.identity = identity


def find_stage(reg: Registry, source_identity: str, key: str) -> StageRecord | None:
    """The ledger record of ``key``, if that stage finished before."""
    art = reg.find_source_artifact(_Identity(source_identity), STAGE_KIND, key)
    return None if art is None else StageRecord.model_validate(art.meta)


def record_stage(reg: Registry, *, model: str, architecture: str | None, source: SourceRef, record: StageRecord,
                 scratch: Path) -> StageRecord:
    """Write ``record`` to the ledger (idempotent: an existing record under the same key is kept and
    returned, so two stages racing on one key end with one record)."""
    body = record.model_dump(mode="json")
    path = scratch / f"stage-{record.key[:16]}.json"
    path.write_text(json.dumps(body, sort_keys=True, indent=1), encoding="utf-8")
    label = "".join(c if c.isalnum() or c in "._-" else "-" for c in record.stage)
    name = f"stage-{label}-{record.key[:12]}.json"
    art = reg.put_source_artifact(model=model, architecture=architecture, source=source, kind=STAGE_KIND,
                                  key=record.key, name=name, path=path, meta=body)
    return StageRecord.model_validate(art.meta)


def pin_source(source: SourceInput, settings: Settings) -> tuple[str, SourceInput, SourceRef]:
    """Pin a source without downloading it: a hub revision to its current commit (one API call), a folder
    to its content hash (cached by size and mtime). Returns (identity, the input pinned to exactly that,
    a SourceRef for registry rows).

    Raises:
        SourceNotFoundError / SourceAccessError: the folder or the hub repo or revision does not exist.
    """
    path = Path(source.source).expanduser()
    if path.exists() or not looks_like_hub_id(source.source):
        if not path.is_dir():
            raise SourceNotFoundError(f"source {source.source} does not exist",
                                      hint="pass an existing checkpoint folder or a hub id owner/name; in "
                                           "multi-machine mode a folder must be on a filesystem every worker mounts")
        with stage(RESOLVE_PARTS["hash"], source.source):
            digest = content_hash(path, HashCache(settings.cache_dir / "hashes.sqlite"))
        ref = SourceRef(kind=SourceKind.LOCAL, path=str(path.resolve()), content_hash=digest)
        return ref.identity, pinned_input(source, ref), ref
    commit = hub_commit(source.source, source.revision, HubOptions(
        endpoint=settings.hf_endpoint, cache_dir=settings.hf_cache_dir, offline=settings.hf_offline))
    ref = SourceRef(kind=SourceKind.HUB, path="", repo_id=source.source, revision=source.revision or "main",
                    commit=commit)
    return ref.identity, pinned_input(source, ref), ref


def pinned_input(source: SourceInput, ref: SourceRef) -> SourceInput:
    """``source`` pinned to exactly ``ref``: a folder by its absolute path (its content hash is the
    identity), a hub repo at its commit."""
    if ref.kind == SourceKind.HUB:
        return source.model_copy(update={"revision": ref.commit})
    return source.model_copy(update={"source": ref.path})


def hub_commit(repo_id: str, revision: str | None, hub: HubOptions) -> str:
    """The commit SHA ``revision`` (default main) of ``repo_id`` points at now (the cached mapping when offline)."""
    from huggingface_hub import HfApi

    rev = revision or "main"
    with hub_errors(repo_id, rev):
        return str(HfApi(endpoint=hub.endpoint, token=hub.token).resolve_revision(
            repo_id, revision=rev, cache_dir=hub.cache_dir, local_files_only=hub.offline).resolved)


class Stopwatch:
    """Accumulates seconds spent in ``with watch:`` blocks (the work part of a stage)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._t0 = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.total += time.perf_counter() - self._t0
