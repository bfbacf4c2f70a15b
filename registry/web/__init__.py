"""The registry's web listing and JSON API (FastAPI under uvicorn, Jinja2 pages, inline SVG charts).

Start it with ``quantyard serve``, or build the ASGI app yourself::

    from registry import open_registry
    from registry.web import create_app

    app = create_app(open_registry(settings, create=False), token=settings.web_token.get_secret_value())

Everything it serves (styles, the small sorting script) comes from ``registry/web/static``: no CDN.
"""

from __future__ import annotations

from registry.web.app import create_app

__all__ = ["create_app"]
