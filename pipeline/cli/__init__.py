"""The ``quantyard`` command line (Typer + Rich).

``common`` holds what every command uses (the app, shared options, settings, exit codes); each other
module is one group of commands with a ``register(app)`` function, and this module is the one place
they are put together, in the order ``quantyard --help`` lists them.

Exit codes: 0 success; 1 a check failed (validate, verify); 2 bad usage or bad input
(typed errors from pipeline.errors); 3 a tool or engine failed; 4 an internal error.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

from pipeline.cli import browse, convert, demo, deploy, doctor, env, recommend, registry, serve, validate, web, work
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
work.register(app)
doctor.register(app)


def main() -> None:
    try:
        app()
    except SystemExit as exc:
        # click reports usage errors with exit code 2 already; keep it.
        leave(exc.code)
    leave(0)


def leave(code: int | str | None) -> None:
    """End the process with ``code`` after everything a normal exit does that matters, in a normal exit's
    order: first the threading module's exit hooks (``threading._shutdown``: Prefect drains its log and event
    workers there, sending a failed run's error logs to the server), then every atexit handler (Quantyard
    stops Prefect's embedded server, logging flushes, temporary folders go), then the standard streams are
    flushed, and the interpreter's teardown of its modules is skipped: after a run that imported torch,
    transformers and Prefect's server that teardown took about 2 s on 2 cores and does nothing a finished
    command needs. Without the first step the server was stopped before the log worker had sent its last
    batch: a failed run's logs never reached Prefect and the command ended on "Error logging to API". A
    normal exit (``sys.exit``) instead while a non-daemon thread still runs (it would be cut short) or when
    ``QUANTYARD_FULL_EXIT`` is set."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if others or os.environ.get("QUANTYARD_FULL_EXIT"):
        sys.exit(code)
    if isinstance(code, str):  # sys.exit("message"): printed to stderr, status 1
        print(code, file=sys.stderr)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls before the atexit handlers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            stream.flush()
    os._exit(status)


__all__ = ["app", "main"]
