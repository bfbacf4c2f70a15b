"""InProcess.flushed_beside: the embedded run's pending source records are written in a thread while a build's body
runs, and the block's end waits for them. The flush itself (blob store, ledger) is the real one in the flow tests
(tests/flows/test_quantize_flow.py, tests/reliability/test_crash.py); here it is replaced by one that records what
it saw, so that the ordering contract is checked exactly."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from flows.stages import InProcess
from pipeline.config import Settings

WAIT_S = 10.0


class _Flush(InProcess):
    """An InProcess whose flush waits for the block to have run (or fails), and says what it saw."""

    def __init__(self, fail: Exception | None = None) -> None:
        super().__init__(settings=Settings(), resolved=None)  # type: ignore[arg-type]
        self.pending.append(("request", "record", "who"))  # type: ignore[arg-type]
        self.fail = fail
        self.started = threading.Event()
        self.block_ran = threading.Event()
        self.saw_block = False
        self.finished = False
        self.thread: str | None = None

    def flush(self, reg: Any) -> None:
        self.thread = threading.current_thread().name
        self.started.set()
        self.saw_block = self.block_ran.wait(WAIT_S)
        if self.fail is not None:
            raise self.fail
        self.pending.clear()
        self.finished = True


def test_the_records_are_written_while_the_block_runs_and_before_it_ends() -> None:
    here = _Flush()
    with here.flushed_beside(None, logging.getLogger("test")):  # type: ignore[arg-type]
        assert here.started.wait(WAIT_S), "the flush did not start while the block ran"
        here.block_ran.set()
    assert here.saw_block and here.finished and not here.pending  # it ran beside the block, and the end waited
    assert here.thread == "quantyard-flush"


def test_a_failed_write_is_raised_when_the_block_succeeded() -> None:
    here = _Flush(fail=OSError("blob store full"))
    with pytest.raises(OSError, match="blob store full"), \
            here.flushed_beside(None, logging.getLogger("test")):  # type: ignore[arg-type]
        here.block_ran.set()
    assert here.pending  # nothing was written: the next stage's flush tries again


def test_the_blocks_error_wins_and_the_failed_write_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    here = _Flush(fail=OSError("blob store full"))
    with caplog.at_level(logging.WARNING, logger="test"), pytest.raises(ValueError, match="quantize failed"), \
            here.flushed_beside(None, logging.getLogger("test")):  # type: ignore[arg-type]
        here.block_ran.set()
        raise ValueError("quantize failed")
    assert here.saw_block and here.pending
    assert "OSError: blob store full" in caplog.text and "stays pending" in caplog.text


def test_the_blocks_error_comes_after_the_records_are_written() -> None:
    here = _Flush()
    with pytest.raises(ValueError, match="quantize failed"), \
            here.flushed_beside(None, logging.getLogger("test")):  # type: ignore[arg-type]
        here.block_ran.set()
        raise ValueError("quantize failed")
    assert here.finished and not here.pending  # a failed build leaves the source's records, as before


def test_nothing_pending_starts_no_thread() -> None:
    here = _Flush()
    here.pending.clear()
    with here.flushed_beside(None, logging.getLogger("test")):  # type: ignore[arg-type]
        pass
    assert here.thread is None
