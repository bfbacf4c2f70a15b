"""The ``quantyard`` command line (Typer + Rich).

``common`` holds what every command uses (the app, shared options, settings, exit codes); each other
module is one group of commands with a ``register(app)`` function, and this module is the one place
they are put together, in the order ``quantyard --help`` lists them.

Exit codes: 0 success; 1 a check failed (validate, verify); 2 bad usage or bad input
(typed errors from pipeline.errors); 3 a tool or engine failed; 4 an internal error.
"""

from __future__ import annotations

import sys

from pipeline.cli import browse, convert, demo, deploy, env, recommend, registry, serve, validate, web
from pipeline.cli.common import app

convert.register(app)
browse.register(app)
demo.register(app)
registry.register(app)
deploy.register(app)
validate.register(app)
recommend.register(app)
serve.register(app)
web.register(app)
env.register(app)


def main() -> None:
    try:
        app()
    except SystemExit as exc:
        # click reports usage errors with exit code 2 already; keep it.
        sys.exit(exc.code)


__all__ = ["app", "main"]
