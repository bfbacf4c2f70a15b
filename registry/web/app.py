"""The FastAPI application: pages, the JSON API, static files, and one error mapping for both."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import (
    IllegalTransitionError,
    IntegrityError,
    InvalidReferenceError,
    InvalidSpecError,
    NotFoundError,
    QuantyardError,
)
from registry.store import Registry
from registry.web.cache import ResponseCache
from registry.web.format import (
    cell_text,
    engine_html,
    engine_label,
    human_size,
    memory_html,
    metric_cells_html,
    ms,
    number,
    path_quote,
    tok_s,
)

HERE = Path(__file__).parent
log = logging.getLogger("quantyard.web")

_SEG = r"[A-Za-z0-9][A-Za-z0-9._\-]*"


class _Pattern(Convertor[str]):
    """A path segment pattern; ``regex`` is a class variable of starlette's Convertor, set by each subclass."""

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


# Registry names in paths: a model is `name` or `owner/name`; a variant adds `/VARIANT`; a reference may add
# `@VERSION|@ALIAS`. None of them can contain `/-/`, which separates sub-resources.
class _Model(_Pattern):
    regex = rf"{_SEG}(?:/{_SEG})?"


class _Variant(_Pattern):
    regex = rf"{_SEG}(?:/{_SEG})?/{_SEG}"


class _Ref(_Pattern):
    regex = rf"{_SEG}(?:/{_SEG})?/{_SEG}(?:@{_SEG})?"


register_url_convertor("qmodel", _Model())
register_url_convertor("qvariant", _Variant())
register_url_convertor("qref", _Ref())


def _status(exc: QuantyardError) -> int:
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, IllegalTransitionError):
        return 409
    if isinstance(exc, InvalidReferenceError | InvalidSpecError):
        return 400
    if isinstance(exc, IntegrityError):
        return 500
    return 400 if exc.exit_code == 2 and not exc.code.startswith("registry") else 500


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def _error(request: Request, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    if _wants_json(request):
        return JSONResponse(payload, status_code=status, headers=headers)
    templates: Jinja2Templates = request.app.state.templates
    return templates.TemplateResponse(request, "error.html", {"status": status, "error": payload},
                                      status_code=status, headers=headers)


async def _quantyard_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, QuantyardError)
    status = _status(exc)
    if status >= 500:
        log.error("%s %s: %s", request.method, request.url.path, exc)
    return _error(request, status, exc.to_dict())


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}.get(
        exc.status_code, "http_error")
    detail = exc.detail if exc.status_code != 404 or exc.detail != "Not Found" else \
        f"nothing at {request.url.path}: not a model, variant, version or file of this registry"
    return _error(request, exc.status_code, {"error": code, "type": "HTTPException", "message": detail,
                                             "hint": None}, headers=getattr(exc, "headers", None))


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
    return _error(request, 422, {"error": "invalid_request", "type": "RequestValidationError",
                                 "message": "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors),
                                 "hint": None, "details": errors})


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(size=human_size, num=number, path=path_quote)
    env.globals.update(cells_html=metric_cells_html, engine_html=engine_html, engine_label=engine_label,
                       cell_text=cell_text,
                       memory_html=memory_html, ms=ms, tok_s=tok_s)
    return Jinja2Templates(env=env)


def create_app(registry: Registry, *, token: str | None = None, cache_entries: int = 256,
               cache_ttl_s: float = 10.0) -> FastAPI:
    """The web listing and API over ``registry``. ``token`` enables the write endpoints;
    ``cache_entries=0`` turns the response cache off (see :mod:`registry.web.cache`)."""
    from registry.web import api, pages

    app = FastAPI(title="Quantyard registry", version="1", openapi_url="/api/v1/openapi.json",
                  docs_url=None, redoc_url=None,  # FastAPI's doc pages load scripts from a CDN
                  description="Browse models and quantized variants, their evaluation results and files.")
    app.state.registry = registry
    app.state.token = token or None
    app.state.cache = ResponseCache(cache_entries, cache_ttl_s)
    app.state.templates = _templates()
    app.add_exception_handler(QuantyardError, _quantyard_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.include_router(api.router)
    app.include_router(pages.router)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(SecurityHeaders)
    return app


class SecurityHeaders:
    """Pure ASGI middleware (streamed downloads pass through untouched): nosniff everywhere, and a
    content security policy on pages."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def wrapped(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                if b"x-content-type-options" not in names:
                    headers.append((b"x-content-type-options", b"nosniff"))
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if ctype.startswith(b"text/html"):
                    headers.append((b"content-security-policy", CSP.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, wrapped)


# Everything is served from this origin: no CDN, no inline scripts.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
       "base-uri 'none'; frame-ancestors 'none'")
