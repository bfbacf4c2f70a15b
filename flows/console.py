"""What Prefect prints on the terminal when a stage fails with one of Quantyard's typed errors.

Prefect logs a failed task run with its traceback, and its console handler (on the root logger) prints all of
it: a variant whose AWQ calibration failed filled the terminal with Quantyard's own call stack (stages, steps,
the converter) above a results table whose status line already says what failed and what to do. A typed error
(:class:`pipeline.errors.QuantyardError`) is an expected outcome with its own message, hint and log path, so on
the console its record is printed without the traceback; Prefect's API log handlers, which run before the
root's console handler, still send it whole (the run's logs in Prefect keep it), and any other exception keeps
its traceback everywhere.
"""

from __future__ import annotations

import logging

from pipeline.errors import QuantyardError


class TypedErrorsWithoutTraceback(logging.Formatter):
    """Formats as ``inner`` does, leaving out the traceback of a record whose exception is a QuantyardError."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, QuantyardError):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None  # this handler only: put back before the next one
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def quiet_typed_failures() -> int:
    """Wrap the formatter of Prefect's console handlers on the root logger (idempotent, Prefect imported);
    returns how many are wrapped."""
    from prefect.logging.handlers import PrefectConsoleHandler

    wrapped = 0
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            if not isinstance(handler.formatter, TypedErrorsWithoutTraceback):
                handler.setFormatter(TypedErrorsWithoutTraceback(handler.formatter or logging.Formatter()))
            wrapped += 1
    return wrapped
