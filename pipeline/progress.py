"""In-process progress events: stages announce what they start and finish; the CLI renders them
with Rich. Listeners are process-local, so flows and tasks stay free of UI code."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    stage: str  # e.g. "convert_base", "quantize", "evaluate"
    detail: str
    phase: str  # "start" | "done" | "failed"


#: The parts of resolving a source, each a progress event of its own (detail: the source as given), so what a
#: long resolve is doing shows while it runs and bench/scaling.py can time each part (their costs scale
#: differently): the folder's content hash (``fetch`` for a hub revision), the checks (config, shapes, tokenizer,
#: the formats'), the NaN/Inf scan of every weight. ``hash`` also announces the ledger's pinning of a folder
#: (flows/ledger.py ``pin_source``), which hashes it before the run decides whether anything must run.
RESOLVE_PARTS = {"hash": "resolve:hash", "fetch": "resolve:fetch", "check": "resolve:check", "scan": "resolve:scan"}

_listeners: list[Callable[[Event], None]] = []
_lock = threading.Lock()


def emit(stage: str, detail: str = "", phase: str = "start") -> None:
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        fn(Event(stage, detail, phase))


@contextmanager
def listening(fn: Callable[[Event], None]) -> Iterator[None]:
    with _lock:
        _listeners.append(fn)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(fn)


@contextmanager
def stage(name: str, detail: str = "") -> Iterator[None]:
    emit(name, detail, "start")
    try:
        yield
    except BaseException:
        emit(name, detail, "failed")
        raise
    emit(name, detail, "done")
