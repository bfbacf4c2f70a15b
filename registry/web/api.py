"""JSON API under ``/api/v1`` (schema at ``/api/v1/openapi.json``, docs at ``/api/v1/docs``).

Paths name registry objects the way the CLI does: ``MODEL`` (``name`` or ``owner/name``),
``MODEL/VARIANT`` and ``MODEL/VARIANT[@VERSION|@ALIAS]``. Sub-resources follow a ``/-/`` separator,
which no name can contain, so every path has exactly one reading.

Reads are open. Writes (move an alias, change a state) need ``Authorization: Bearer <token>`` with
the token from ``QUANTYARD_WEB_TOKEN``; with no token configured they are disabled (403).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field, computed_field
from pydantic_core import to_json

from pipeline.errors import NotFoundError
from pipeline.serving_summary import ServingSummary, serving_summaries
from pipeline.specs import VersionState
from registry.store import Registry
from registry.views import (
    AuditView,
    FileView,
    LineageView,
    ModelView,
    ResultView,
    VariantSummary,
    VersionView,
)
from registry.web.cache import ResponseCache
from registry.web.commands import download_path
from registry.web.downloads import file_response
from registry.web.table import Row, row_from_summary, with_floors

router = APIRouter(prefix="/api/v1", tags=["registry"])


def registry_of(request: Request) -> Registry:
    return request.app.state.registry


Reg = Annotated[Registry, Depends(registry_of)]


class ModelDetail(BaseModel):
    model: ModelView
    variants: list[VariantSummary]


class FileLink(FileView):
    url: str


class AliasRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    note: str | None = Field(default=None, max_length=2000)


class StateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    state: VersionState
    note: str | None = Field(default=None, max_length=2000)


class VersionOut(VersionView):
    """A version as the API returns it: with its pinned reference ``MODEL/VARIANT@N``."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ref(self) -> str:
        return f"{self.model}/{self.variant}@{self.number}"


def _version_out(view: VersionView) -> VersionOut:
    return VersionOut.model_validate(view.model_dump())


def require_token(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """Check the bearer token; returns the actor name recorded in the audit log."""
    expected: str | None = request.app.state.token
    if expected is None:
        raise HTTPException(403, detail="writes through the web API are disabled: set QUANTYARD_WEB_TOKEN on the "
                                        "server to enable them")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise HTTPException(401, detail="this endpoint needs 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": 'Bearer realm="quantyard"'})
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise HTTPException(403, detail="the bearer token is not valid for this server")
    client = request.client.host if request.client else "unknown"
    return f"web-api@{client}"


Actor = Annotated[str, Depends(require_token)]


def cached_json(request: Request, reg: Registry, value: Callable[[], Any]) -> Response:
    """``value()`` as JSON (serialized by pydantic-core, no re-validation), through the response cache."""
    cache: ResponseCache = request.app.state.cache
    return cache.respond(request, reg, lambda: Response(to_json(value()), media_type="application/json"))


@router.get("/models", response_model=list[ModelView])
def list_models(request: Request, reg: Reg, q: str | None = None, architecture: str | None = None,
                format: str | None = None) -> Response:
    """Models, optionally filtered by a name substring, architecture or format."""
    return cached_json(request, reg, lambda: reg.list_models(architecture=architecture or None,
                                                             format=format or None, query=q or None))


def _model_detail(reg: Registry, model: str) -> ModelDetail:
    variants = reg.variant_summaries(model)  # raises NotFoundError for an unknown model
    found = [m for m in reg.list_models(query=model) if m.name == model]
    if not found:
        raise NotFoundError(f"model {model!r} is not in the registry")
    return ModelDetail.model_construct(model=found[0], variants=variants)


@router.get("/models/{model:qmodel}", response_model=ModelDetail)
def get_model(request: Request, reg: Reg, model: str) -> Response:
    """One model and every variant with its latest version (state, aliases, size, bpw, results)."""
    return cached_json(request, reg, lambda: _model_detail(reg, model))


@router.get("/models/{model:qmodel}/-/table", response_model=list[Row])
def model_table(request: Request, reg: Reg, model: str) -> Response:
    """The comparison table of a model: the latest version of every variant, metrics on one scale and
    unrounded, and why a metric is missing. ``kld`` is only the exact full-vocabulary KLD (a top-K bound is
    ``kld_lower_bound``, an estimate ``kld_estimate``; ``kld_kind`` says which); the format's own engine's
    results come first and other engines' are ``cross_checks``; ``engine_role``, ``speed_kernel`` and
    ``marks`` say what is a stand-in; ``within_noise_floor`` that the exact KLD is within its reference's noise
    floor."""
    return cached_json(request, reg, lambda: _table(reg, model))


def _table(reg: Registry, model: str) -> list[Row]:
    summaries = reg.variant_summaries(model)
    floors = reg.noise_floors({s.source["identity"] for s in summaries if s.source and s.source.get("identity")})
    return with_floors([row_from_summary(s) for s in summaries], floors)


def _serving(reg: Registry, model: str) -> list[ServingSummary]:
    return [x for s in reg.variant_summaries(model) for x in serving_summaries(s.variant, s.ref, s.format, s.results)]


@router.get("/models/{model:qmodel}/-/serving", response_model=list[ServingSummary])
def model_serving(request: Request, reg: Reg, model: str) -> Response:
    """The serving figures of a model: for the latest version of every variant, the newest serving result of each
    engine that served it (the format's own engine first), without the per-request logs: server and version,
    load profile (``cpu_scaled`` when its shape was scaled down for a CPU; ``profile_note`` says how), ``kernel``
    when vLLM's 4-bit kernel was replaced by a dense matmul, every closed-loop level's TTFT / ITL / TPOT
    percentiles (ms) and output tok/s, and the measured memory (``peak_bytes``: device on a GPU, else the
    server's RSS, at ``context`` tokens per request with ``users`` users). The full results, per-request logs
    included, are a version's ``/-/results`` (``kind`` serving)."""
    return cached_json(request, reg, lambda: _serving(reg, model))


@router.get("/variants/{variant:qvariant}/-/versions", response_model=list[VersionOut])
def list_versions(request: Request, reg: Reg, variant: str) -> Response:
    """Every version of ``MODEL/VARIANT``, oldest first."""
    model, _, name = variant.rpartition("/")
    return cached_json(request, reg, lambda: [_version_out(v) for v in reg.list_versions(model, name)])


@router.get("/versions/{ref:qref}", response_model=VersionOut)
def get_version(request: Request, reg: Reg, ref: str) -> Response:
    """One version (``@latest`` without a selector)."""
    return cached_json(request, reg, lambda: _version_out(reg.get_version(ref)))


@router.get("/versions/{ref:qref}/-/results", response_model=list[ResultView])
def get_results(request: Request, reg: Reg, ref: str) -> Response:
    """Evaluation results of a version (quality, speed and serving, per engine), oldest first."""
    return cached_json(request, reg, lambda: reg.get_version(ref).results)


@router.get("/versions/{ref:qref}/-/lineage", response_model=LineageView)
def get_lineage(request: Request, reg: Reg, ref: str) -> Response:
    """Where a version's bytes came from: source commit or content hash, tool, parameters, environment."""
    return cached_json(request, reg, lambda: reg.lineage(ref))


def _files(reg: Registry, ref: str) -> list[FileLink]:
    view = reg.get_version(ref)
    return [FileLink(**f.model_dump(), url=download_path(view.ref, f.name)) for f in view.files]


@router.get("/versions/{ref:qref}/-/files", response_model=list[FileLink])
def list_files(request: Request, reg: Reg, ref: str) -> Response:
    """Files of a version with their sha256, size and download path (pinned to the version number)."""
    return cached_json(request, reg, lambda: _files(reg, ref))


DOWNLOAD_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "The whole file, verified while streaming"},
    206: {"description": "Partial content (Range)"}, 304: {"description": "Not modified (If-None-Match)"},
    416: {"description": "Range not satisfiable"}}


@router.get("/versions/{ref:qref}/-/files/{name:path}", response_class=Response, responses=DOWNLOAD_RESPONSES)
def download(request: Request, reg: Reg, ref: str, name: str) -> Response:
    """Download one file. Supports ``Range`` (one range), ``If-Range``, ``If-None-Match`` and ``HEAD``; the
    ``ETag`` is the file's sha256. A whole-file download is verified against it while streaming, and cut
    short (the connection closes before ``Content-Length`` bytes) if the stored bytes do not match."""
    return file_response(request, reg, ref, name)


@router.head("/versions/{ref:qref}/-/files/{name:path}", response_class=Response, include_in_schema=False)
def download_head(request: Request, reg: Reg, ref: str, name: str) -> Response:
    return file_response(request, reg, ref, name)


@router.get("/audit", response_model=list[AuditView])
def audit(request: Request, reg: Reg, model: str | None = None, variant: str | None = None,
          limit: int = 200) -> Response:
    """Newest audit events (registrations, alias moves, state changes)."""
    return cached_json(request, reg, lambda: reg.audit_log(model, variant, limit=max(1, min(limit, 1000))))


@router.put("/versions/{ref:qref}/-/aliases/{alias}", response_model=VersionOut)
def set_alias(reg: Reg, actor: Actor, ref: str, alias: str, body: AliasRequest | None = None) -> VersionOut:
    """Point alias ``alias`` of the variant at this version (needs the bearer token)."""
    return _version_out(reg.set_alias(ref, alias, by=actor, note=body.note if body else None))


@router.delete("/variants/{variant:qvariant}/-/aliases/{alias}", status_code=204, response_class=Response)
def delete_alias(reg: Reg, actor: Actor, variant: str, alias: str) -> Response:
    """Remove an alias from a variant (needs the bearer token)."""
    model, _, name = variant.rpartition("/")
    reg.delete_alias(model, name, alias, by=actor)
    return Response(status_code=204)


@router.post("/versions/{ref:qref}/-/state", response_model=VersionOut)
def set_state(reg: Reg, actor: Actor, ref: str, body: StateRequest) -> VersionOut:
    """Move a version to another state (needs the bearer token). Illegal moves answer 409."""
    return _version_out(reg.set_state(ref, body.state, by=actor, note=body.note))
