"""``quantyard serve``: the registry's web listing and JSON API under uvicorn."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.common import RegistryOpt, handle_errors, settings


@handle_errors
def serve(
    registry: RegistryOpt = None,
    host: Annotated[str, typer.Option(help="Interface to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.", min=0, max=65535)] = 8000,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the registry: model pages with comparison tables and charts, downloads, and /api/v1 (JSON).

    Writes through the API (aliases, states) need QUANTYARD_WEB_TOKEN; without it they are disabled.
    """
    import uvicorn

    from pipeline.render import err_console
    from registry import open_registry
    from registry.web import create_app

    cfg = settings(registry)
    reg = open_registry(cfg, create=False)  # fail here, with a typed error, on a bad location
    token = cfg.web_token.get_secret_value() if cfg.web_token is not None else None
    err_console.print(f"serving {reg.engine.url.render_as_string(hide_password=True)} on "
                      f"http://{host}:{port}/ (writes {'enabled' if token else 'disabled: no QUANTYARD_WEB_TOKEN'})")
    app = create_app(reg, token=token, cache_entries=cfg.web_cache_entries)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def register(app: typer.Typer) -> None:
    app.command()(serve)
