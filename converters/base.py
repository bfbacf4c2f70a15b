"""The Converter protocol: what every format (GGUF, AWQ, EXL2) implements.

A conversion has two phases so shared work happens once per source:

1. ``prepare`` builds what every variant of the format shares (the GGUF F16
   base, the EXL2 measurement) and returns plain paths and flags;
2. ``build`` makes one variant from that, into ``out_dir``.

``check`` runs before either and must fail fast (seconds) on anything the
format cannot handle, so no time or disk is spent on doomed work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from converters.checkpoint import Checkpoint
from pipeline.config import Settings
from pipeline.footprint import Need
from pipeline.specs import QuantFormat, SourceRef
from pipeline.texts import text_sha256


@dataclass(frozen=True)
class Calibration:
    """Calibration text for data-aware formats (EXL2, AWQ) and where it came from."""

    text: str
    origin: str

    @property
    def sha256(self) -> str:
        return text_sha256(self.text)


@dataclass(frozen=True)
class BuildContext:
    checkpoint: Checkpoint
    source: SourceRef
    model_name: str
    settings: Settings
    calibration: Calibration | None = None
    #: Source artifacts the flow found in the registry for this source, by "kind:key" (e.g. an EXL2
    #: measurement), so a converter can reuse them instead of recomputing.
    artifacts: dict[str, Path] = field(default_factory=dict)
    #: The texts this run evaluates and calibrates on, by origin label (``checkpoint:eval.txt`` …), for
    #: checks that must hold on them, such as GGUF tokenizer parity.
    texts: dict[str, str] = field(default_factory=dict)

    @property
    def file_stem(self) -> str:
        return self.model_name.rsplit("/", 1)[-1]


@dataclass
class Prepared:
    """What ``prepare`` produced: paths only, so it can cross process and task boundaries."""

    paths: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)  # work actually done, e.g. ["convert_base"]
    #: Files to register as artifacts of the source: {kind, key, name, path, meta} each.
    source_artifacts: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class BuiltVariant:
    variant: str
    files: dict[str, Path]  # logical file name -> path on disk
    tool: dict[str, Any]
    parameters: dict[str, Any]
    events: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Footprint:
    """ESTIMATES of what a format's conversion asks of the machine, before it runs (pipeline/footprint.py): the
    peak memory of each kind of work it does, the bytes of shared files it will write to the work folder that
    are not there yet (a GGUF base), and each variant's expected size by variant name."""

    needs: tuple[Need, ...] = ()
    work_bytes: int = 0
    variant_bytes: dict[str, int] = field(default_factory=dict)


class Converter(Protocol):
    format: ClassVar[QuantFormat]

    def tool_identity(self) -> dict[str, Any]:
        """Name and exact versions of the tools that produce the bytes (part of every build key)."""
        ...

    def check(self, checkpoint: Checkpoint, specs: list[Any]) -> None:
        """Raise a typed error now if any of ``specs`` cannot be built from ``checkpoint``."""
        ...

    def footprint(self, checkpoint: Checkpoint, source: SourceRef, specs: list[Any]) -> Footprint:
        """ESTIMATES of the memory, work-folder disk and variant sizes converting ``specs`` takes (the pre-flight,
        flows/preflight.py, compares them with the machine before any work)."""
        ...

    def prepare(self, ctx: BuildContext, specs: list[Any]) -> Prepared: ...

    def build(self, ctx: BuildContext, prepared: Prepared, spec: Any, out_dir: Path) -> BuiltVariant: ...
