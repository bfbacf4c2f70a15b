"""A real uvicorn server for web tests: the app on a free loopback port, served from a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from registry import open_registry
from registry.web import create_app
from tests.registry.servers import free_port


@contextmanager
def serving(location: str, token: str | None = None, blobs: str | None = None) -> Iterator[str]:
    """Serve the registry at ``location``; yields the base URL (``http://127.0.0.1:PORT``)."""
    app = create_app(open_registry(location, blobs=blobs, create=False), token=token)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
