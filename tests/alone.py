"""The ``alone`` marker: a test that needs the machine to itself (a speed comparison) under pytest-xdist.

tests/conftest.py imports the run-time hook and the summary, and orders the tests with :func:`alone_last`;
tests/test_alone.py loads this module as a plugin (``-p tests.alone``) in a pytest run of its own to check it."""

from __future__ import annotations

import fcntl
import tempfile
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Under xdist, a test marked ``alone`` has the machine to itself: it waits for the other workers' tests in
    progress to end, and they start no new test (fixture set-up included) until it has ended.

    Every test holds the run's machine lock shared, an ``alone`` test holds it exclusively. A short gate lock,
    taken before either, keeps a waiting ``alone`` test from being starved by the others' stream of shared
    holds: a worker whose next test finds the gate taken waits there. A worker's idle servers from earlier
    tests (module fixtures) stay up, but idle. Without xdist (one process) there is nothing to wait for."""
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run is None:
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    # xdist gives each worker <the run's basetemp>/popen-gwN: the locks live in the run's folder and go with it.
    folder = Path(item.config.option.basetemp).parent if item.config.option.basetemp else Path(tempfile.gettempdir())
    base = folder / f"alone-{run}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.machine", "a") as machine:
        t0 = time.monotonic()
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        if alone:  # reported at the end of the run (pytest_terminal_summary): what having the machine cost
            item.user_properties.append(("alone_wait_s", round(time.monotonic() - t0, 1)))
        try:
            return (yield)
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


def alone_last(items: list[pytest.Item]) -> None:
    """``alone`` tests go last (a stable sort: the order is otherwise kept), so that under ``make test``
    (``--dist loadfile``, files dealt out in this order) the other worker is in its tail of short tests by then
    and the wait for its test in progress is short, where early in the run it can be a long fixture's set-up."""
    items.sort(key=lambda item: item.get_closest_marker("alone") is not None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    alone_last(items)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How long each ``alone`` test waited for the machine (under xdist)."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        waited = dict(getattr(report, "user_properties", ())).get("alone_wait_s")
        if waited is not None and report.when == "call":
            terminalreporter.write_line(f"alone: {report.nodeid} waited {waited} s for the other workers' tests")
