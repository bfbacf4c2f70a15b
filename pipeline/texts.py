"""Where calibration and evaluation texts come from: the one place that picks them.

A text source is, in order of precedence,

* a file (``--eval-text FILE``, ``--awq-calibration FILE``): origin ``file:NAME``;
* a dataset, ``NAME:SPLIT``, ``NAME:CONFIG:SPLIT`` or ``NAME:CONFIG:SPLIT:COLUMN`` (the ``EvalSpec.dataset``
  form; a calibration names it ``dataset:…``), loaded with the optional ``datasets`` package: origin
  ``dataset:SPEC``;
* the checkpoint's own ``eval.txt`` / ``calibration.txt`` (the demo and real checkpoints ship them): origin
  ``checkpoint:FILE``, plus where the text came from when the checkpoint records it;
* the built-in split of the Python standard library's sources (the demo model's corpus): origin
  ``builtin:python-stdlib-heldout`` / ``builtin:python-stdlib-calibration``.

Every picker returns ``(text, origin)``. Origins are stored in registries and lineage: they never change.
This is pipeline core: it imports no converter, evaluator, registry or flow.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from functools import lru_cache
from pathlib import Path

from pipeline.errors import ConfigError

#: The texts a checkpoint may carry beside its weights.
EVAL_TEXT = "eval.txt"
CALIB_TEXT = "calibration.txt"
#: The record a built real checkpoint keeps of where its texts came from (written by pipeline.real_model).
PROVENANCE_FILE = "quantyard-real.json"

BUILTIN_EVAL_ORIGIN = "builtin:python-stdlib-heldout"
BUILTIN_CALIB_ORIGIN = "builtin:python-stdlib-calibration"
#: Byte budgets of the built-in splits (the demo recipe's defaults; its key covers the texts themselves).
MAX_TRAIN_BYTES = 3_000_000
MAX_EVAL_BYTES = 120_000
MAX_CALIB_BYTES = 120_000
DATASET_PREFIX = "dataset:"


def text_sha256(text: str) -> str:
    """sha256 of ``text`` as UTF-8 (the digest lineage and cache keys record)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --- the built-in corpus ------------------------------------------------------------------------------


def split_of(name: str) -> str:
    """``train``, ``calib`` or ``eval``: a stdlib module's split, by a hash of its file name."""
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 20
    return "eval" if bucket == 0 else "calib" if bucket == 1 else "train"


@lru_cache(maxsize=4)
def _corpus(max_train_bytes: int, max_calib_bytes: int, max_eval_bytes: int) -> tuple[tuple[str, str], ...]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: dict[str, list[str]] = {"train": [], "calib": [], "eval": []}
    caps = {"train": max_train_bytes, "calib": max_calib_bytes, "eval": max_eval_bytes}
    used = dict.fromkeys(parts, 0)
    for path in sorted(stdlib.glob("*.py")):
        split = split_of(path.name)
        if used[split] >= caps[split]:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        text = text[: caps[split] - used[split]]
        parts[split].append(text)
        used[split] += len(text)
    return tuple((k, "\n".join(v)) for k, v in parts.items())


def builtin_corpus(max_train_bytes: int = MAX_TRAIN_BYTES, max_calib_bytes: int = MAX_CALIB_BYTES,
                   max_eval_bytes: int = MAX_EVAL_BYTES) -> dict[str, str]:
    """The ``train`` / ``calib`` / ``eval`` texts from the stdlib's top-level modules, each cut to its budget:
    present on every machine, and calibration never overlaps evaluation."""
    return dict(_corpus(max_train_bytes, max_calib_bytes, max_eval_bytes))


def builtin_eval_text() -> tuple[str, str]:
    """The built-in held-out split (the offline default evaluation text)."""
    return builtin_corpus()["eval"], BUILTIN_EVAL_ORIGIN


def builtin_calibration_text() -> tuple[str, str]:
    """The built-in calibration split (the default calibration text of a checkpoint without its own)."""
    return builtin_corpus()["calib"], BUILTIN_CALIB_ORIGIN


# --- files, datasets, the checkpoint's own texts -------------------------------------------------------


def file_text(path: str | Path, *, what: str, hint: str) -> tuple[str, str]:
    """A text file: its text and origin ``file:NAME``. Raises ConfigError (``what`` names it) when missing or
    not UTF-8."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{what} {p} {'is a folder, not a file' if p.is_dir() else 'does not exist'}", hint=hint)
    return read_utf8(p, what), f"file:{p.name}"


def read_utf8(path: Path, what: str) -> str:
    """``path``'s text. Raises ConfigError naming ``what`` and the first bad byte where it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start} ({exc.reason})", hint="pass a UTF-8 text file (convert it with iconv)") from exc


def parse_dataset_spec(spec: str) -> tuple[str, str | None, str, str]:
    """``NAME:SPLIT``, ``NAME:CONFIG:SPLIT`` or ``NAME:CONFIG:SPLIT:COLUMN`` → (name, config, split, column)."""
    parts = spec.split(":")
    if len(parts) == 2:
        return parts[0], None, parts[1], "text"
    if len(parts) in (3, 4):
        return parts[0], parts[1] or None, parts[2], parts[3] if len(parts) == 4 else "text"
    raise ConfigError(f"invalid dataset spec {spec!r}: expected NAME:SPLIT or NAME:CONFIG:SPLIT[:COLUMN]",
                      hint="e.g. wikitext:wikitext-2-raw-v1:test")


def dataset_text(spec: str, *, needs: str = "a dataset",
                 hint: str = "pip install datasets (and be online), or pass a text file") -> tuple[str, str]:
    """A dataset's rows joined by blank lines, and origin ``dataset:SPEC`` (``spec`` with or without the
    ``dataset:`` prefix). Raises ConfigError when ``datasets`` is not installed (``needs`` says what asked
    for it) or the spec is malformed."""
    spec = spec.removeprefix(DATASET_PREFIX)
    name, config, split, column = parse_dataset_spec(spec)
    try:
        import datasets  # optional dependency
    except ImportError as exc:
        raise ConfigError(f"{needs} needs the optional 'datasets' package", hint=hint) from exc
    ds = datasets.load_dataset(name, config, split=split)
    return "\n\n".join(str(t) for t in ds[column]), f"{DATASET_PREFIX}{spec}"


def text_origin(checkpoint: Path, file_name: str) -> str:
    """``checkpoint:FILE``, plus where the text came from when the checkpoint records it."""
    origin = f"checkpoint:{file_name}"
    try:
        prov = json.loads((checkpoint / PROVENANCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return origin
    src = prov["texts"]["source"]
    return f"{origin} (from {src['pypi']}:{src['member']} sha256:{src['member_sha256']}, {src['license']})"


def checkpoint_text(checkpoint: Path, file_name: str) -> tuple[str, str] | None:
    """The checkpoint's own ``file_name`` text and its origin, or None when it has none."""
    own = checkpoint / file_name
    if not own.is_file():
        return None
    return read_utf8(own, f"the checkpoint's {file_name}"), text_origin(checkpoint, file_name)


# --- the pickers --------------------------------------------------------------------------------------


def eval_text(checkpoint: Path, *, file: str | None = None, dataset: str | None = None) -> tuple[str, str]:
    """The evaluation text: ``file`` (--eval-text), else ``dataset`` (--eval-dataset), else the checkpoint's
    own held-out ``eval.txt``, else the built-in held-out split (offline default)."""
    if file:
        return file_text(file, what="evaluation text", hint="pass an existing --eval-text file")
    if dataset:
        return dataset_text(dataset, needs="--eval-dataset",
                            hint="pip install datasets (and be online), or pass --eval-text FILE")
    return checkpoint_text(checkpoint, EVAL_TEXT) or builtin_eval_text()


def calibration_text(checkpoint: Path, source: str | None = None) -> tuple[str, str]:
    """The calibration text: ``source`` (a file, or ``dataset:SPEC``), else the checkpoint's own
    ``calibration.txt``, else the built-in calibration split; never overlaps the default evaluation text."""
    if source and source.startswith(DATASET_PREFIX):
        return dataset_text(source, needs="a calibration dataset",
                            hint="pip install datasets, or pass a calibration text file")
    if source:
        return file_text(source, what="calibration text", hint="pass an existing text file")
    return checkpoint_text(checkpoint, CALIB_TEXT) or builtin_calibration_text()


__all__ = ["BUILTIN_CALIB_ORIGIN", "BUILTIN_EVAL_ORIGIN", "CALIB_TEXT", "EVAL_TEXT", "PROVENANCE_FILE",
           "builtin_calibration_text", "builtin_corpus", "builtin_eval_text", "calibration_text", "checkpoint_text",
           "dataset_text", "eval_text", "file_text", "parse_dataset_spec", "read_utf8", "split_of", "text_origin",
           "text_sha256"]
