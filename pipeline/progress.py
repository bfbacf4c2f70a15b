"""In-process progress events: stages announce what they start and finish, and long work inside a stage says
where it is (``phase="progress"``: tensor i of N, window i of N); the CLI renders them with Rich and the
executors write them to Prefect's run log. Listeners are process-local, so flows and tasks stay free of UI code.

Where a stage's work runs in a tool (llama.cpp's converter and llama-quantize, an engine's runner), its output is
read while it runs (pipeline/proc.py ``run_logged(progress=...)``) and each line given to a :data:`Parser` that
recognises the tool's own progress lines (:func:`quantize_line`, :func:`convert_line`, :func:`runner_line`). The
event goes to the innermost stage open in this context (:func:`stage` keeps that in a context variable, so a
stage running in a thread of its own reports under its own name).
"""

from __future__ import annotations

import contextvars
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    stage: str  # e.g. "convert_base", "quantize", "evaluate"
    detail: str
    phase: str  # "start" | "done" | "failed" | "progress" | "note" (``detail``: what to say)
    done: float | None = None  # with "progress": how far (units of ``unit``)
    total: float | None = None
    unit: str = ""
    rate: str = ""  # e.g. "312 tok/s", where the tool says


#: The parts of resolving a source, each a progress event of its own (detail: the source as given), so what a
#: long resolve is doing shows while it runs and bench/scaling.py can time each part (their costs scale
#: differently): the folder's content hash (``fetch`` for a hub revision), the checks (config, shapes, tokenizer,
#: the formats', the pre-flight), the NaN/Inf scan of every weight. ``hash`` also announces the ledger's pinning
#: of a folder (flows/ledger.py ``pin_source``), which hashes it before the run decides whether anything must run.
RESOLVE_PARTS = {"hash": "resolve:hash", "fetch": "resolve:fetch", "check": "resolve:check", "scan": "resolve:scan"}
#: What a runner writes on stderr to say where it is: ``quantyard-progress windows 3/8 tokens=1536``.
RUNNER_PREFIX = "quantyard-progress"

_listeners: list[Callable[[Event], None]] = []
_lock = threading.Lock()
_open: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("quantyard_stages", default=())


def emit(stage: str, detail: str = "", phase: str = "start", **progress: object) -> None:
    with _lock:
        listeners = list(_listeners)
    event = Event(stage, detail, phase, **progress)  # type: ignore[arg-type]  # done, total, unit, rate by name
    for fn in listeners:
        fn(event)


def note(text: str) -> None:
    """Something the user must know before the work goes on (the reference chosen and why, a refused format)."""
    emit("note", text, "note")


def emit_progress(done: float, total: float | None, unit: str, rate: str = "") -> None:
    """Where the innermost open stage of this context is (nothing when no stage is open)."""
    stack = _open.get()
    if stack:
        emit(*stack[-1], phase="progress", done=done, total=total, unit=unit, rate=rate)


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
    token = _open.set((*_open.get(), (name, detail)))
    try:
        yield
    except BaseException:
        _open.reset(token)
        emit(name, detail, "failed")
        raise
    _open.reset(token)
    emit(name, detail, "done")


# --- tools' progress lines ---------------------------------------------------------------------------------------

#: A parser turns one line of a tool's output into (done, total, unit, rate), or None for any other line.
Parser = Callable[[str], tuple[float, float | None, str, str] | None]

_QUANTIZE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")
_TQDM = re.compile(r"(\d+)%\|.*?\|\s*([0-9.]+[kMGT]?)/([0-9.]+[kMGT]?)")
_RUNNER = re.compile(rf"^{RUNNER_PREFIX}\s+(\w+)\s+(\d+)/(\d+)(?:\s+tokens=(\d+))?")
_SCALE = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def quantize_line(line: str) -> tuple[float, float | None, str, str] | None:
    """llama-quantize's per-tensor line: ``[  12/ 291]  blk.1.attn_k.weight - [...], type = bf16, ...``."""
    m = _QUANTIZE.match(line.strip())
    return (float(m.group(1)), float(m.group(2)), "tensors", "") if m else None


def _bytes(text: str) -> float:
    return float(text[:-1]) * _SCALE[text[-1]] if text[-1] in _SCALE else float(text)


def convert_line(line: str) -> tuple[float, float | None, str, str] | None:
    """convert_hf_to_gguf.py's tqdm bar while it writes the file: ``Writing:  34%|███▍ | 5.03G/14.8G [...]``."""
    m = _TQDM.search(line)
    if not m or "Writing" not in line:
        return None
    return _bytes(m.group(2)) / 1e9, _bytes(m.group(3)) / 1e9, "GB written", ""


def runner_line(line: str) -> tuple[float, float | None, str, str] | None:
    """A runner's own line (evaluators/protocol.py ``report_progress``): windows done, and tokens."""
    m = _RUNNER.match(line.strip())
    if not m:
        return None
    return float(m.group(2)), float(m.group(3)), m.group(1), f"tokens={m.group(4)}" if m.group(4) else ""


class LineWatch:
    """Reads what a running tool appends to its log files and emits the progress lines ``parse`` recognises
    (at most one event per ``every`` seconds, and the last). Lines end at ``\\n`` or ``\\r`` (tqdm)."""

    def __init__(self, parse: Parser, every: float = 1.0) -> None:
        self.parse, self.every = parse, every
        self._offsets: dict[str, int] = {}
        self._rest: dict[str, str] = {}
        self._last = 0.0
        self._pending: tuple[float, float | None, str, str] | None = None

    def poll(self, *paths: str) -> None:
        for path in paths:
            try:
                with open(path, "rb") as fh:
                    fh.seek(self._offsets.get(path, 0))
                    chunk = fh.read()
                    self._offsets[path] = fh.tell()
            except OSError:
                continue
            text = self._rest.get(path, "") + chunk.decode("utf-8", errors="replace")
            lines = re.split(r"[\r\n]", text)
            self._rest[path] = lines.pop()
            for line in lines:
                found = self.parse(line)
                if found is not None:
                    self._pending = found
        self._flush(force=False)

    def _flush(self, force: bool) -> None:
        now = time.monotonic()
        if self._pending is not None and (force or now - self._last >= self.every):
            emit_progress(*self._pending)
            self._pending, self._last = None, now

    def close(self) -> None:
        self._flush(force=True)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def describe(event: Event, elapsed: float) -> str:
    """A progress event in words: ``120/291 tensors (41 %), 3m12s, ETA 4m35s`` (the ETA: the time so far times
    what is left, in proportion; none before the first part is done)."""
    if event.done is None:
        return ""
    total = f"/{event.total:g}" if event.total else ""
    text = f"{event.done:g}{total} {event.unit}"
    if event.total:
        frac = event.done / event.total
        text += f" ({frac:.0%}), {_clock(elapsed)}"
        if 0 < frac < 1:
            text += f", ETA {_clock(elapsed * (1 - frac) / frac)}"
    if event.rate.startswith("tokens=") and elapsed > 0:
        text += f", {int(event.rate.split('=', 1)[1]) / elapsed:.1f} tok/s"
    return text


class Throttle:
    """Which progress events of one stage are worth a line in a log: the first, then each tenth of the way or
    each ``every`` seconds, whichever comes first."""

    def __init__(self, every: float = 60.0) -> None:
        self.every = every
        self.started: dict[tuple[str, str], float] = {}
        self._said: dict[tuple[str, str], tuple[float, float]] = {}

    def elapsed(self, event: Event) -> float:
        return time.monotonic() - self.started.setdefault((event.stage, event.detail), time.monotonic())

    def due(self, event: Event) -> bool:
        key = (event.stage, event.detail)
        if event.phase != "progress":
            if event.phase == "start":
                self.started[key] = time.monotonic()
            return False
        now = time.monotonic()
        frac = event.done / event.total if event.total and event.done is not None else 0.0
        last = self._said.get(key)
        if last is None or now - last[0] >= self.every or frac - last[1] >= 0.1 or frac >= 1 > last[1]:
            self._said[key] = (now, frac)
            return True
        return False
