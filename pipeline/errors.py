"""The one error hierarchy of Quantyard.

Every error subclasses :class:`QuantyardError` *and* the matching builtin, so
callers that only know builtins (``except FileNotFoundError``) still work.
Each carries a stable ``code`` (for JSON output and the web API) and an
``exit_code`` the CLI returns. Messages say what was expected, what was found
and what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_ENGINE = 3
EXIT_INTERNAL = 4


#: The last line of a Python traceback: ``ValueError: …``, ``torch.OutOfMemoryError: …``, ``KeyError: 'n_ctx'``.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")
#: ggml_abort's first line (GGML_ASSERT and GGML_ABORT):
#: ``…/ggml/src/ggml-backend.cpp:205: GGML_ASSERT(buffer) failed``.
_GGML_ABORT = re.compile(r"^(?:\S*/)?((?:ggml|llama)[\w.-]*\.(?:c|cpp|cu|m|h)):(\d+): (.+)$")
#: What a tool puts before its lines: vLLM's ``[rank0]: `` on every line a worker process writes.
_LINE_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


def cause_line(stderr_tail: str, limit: int = 300) -> str | None:
    """The line of a failed tool's stderr that names its failure: the last line that reads like a Python
    exception (the last line of its traceback), else the last abort of ggml/llama.cpp's C code (``GGML_ASSERT(…)
    failed`` or ``GGML_ABORT``'s message, which it writes as ``FILE:LINE: message`` before the process dies of
    SIGABRT); None where there is neither (the tool said something else, and the log named in the error's hint
    holds it)."""
    lines = [_LINE_PREFIX.sub("", line.strip()) for line in stderr_tail.splitlines()]
    found = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), None)
    if found is None:
        aborts = [m for line in lines if (m := _GGML_ABORT.match(line))]
        if aborts:
            found = f"llama.cpp aborted: {aborts[-1].group(3)} ({aborts[-1].group(1)}:{aborts[-1].group(2)})"
    if found is None:
        return None
    return found if len(found) <= limit else found[:limit - 1] + "…"

class QuantyardError(Exception):
    """Base of all Quantyard errors."""

    code: str = "quantyard_error"
    exit_code: int = EXIT_USAGE
    #: What to do, when the raiser has nothing more specific to say. Every error must say what to do.
    default_hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        hint = hint if hint is not None else self.default_hint
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  → {hint}")

    @property
    def cause(self) -> str | None:
        """The failed tool's own last words where it failed with a Python exception (:func:`cause_line` of its
        stderr), unless the message already says them; None otherwise."""
        cause = cause_line(getattr(self, "stderr_tail", "") or "")
        return cause if cause and cause not in self.message else None

    def summary(self) -> str:
        """One line for tables and stored results: type, message, the tool's own last words (:attr:`cause`),
        and what to do (a log path, often)."""
        cause = self.cause
        shown = f" ({cause})" if cause else ""
        return f"{type(self).__name__}: {self.message}{shown}" + (f" → {self.hint}" if self.hint else "")

    def to_dict(self) -> dict[str, str | None]:
        return {"error": self.code, "type": type(self).__name__, "message": self.message, "cause": self.cause,
                "hint": self.hint}


# --- input: sources and checkpoints -------------------------------------------------------------


class SourceNotFoundError(QuantyardError, FileNotFoundError):
    code = "source_not_found"
    default_hint = 'pass an existing checkpoint folder, or a hub id OWNER/NAME with --revision'


class SourceAccessError(QuantyardError, PermissionError):
    """The source exists but this user may not read it (a gated or private hub repository)."""

    code = "source_access"


class InvalidCheckpointError(QuantyardError, ValueError):
    """The source exists but is not a loadable Hugging Face causal-LM checkpoint."""

    code = "invalid_checkpoint"
    default_hint = 'fix or re-download the checkpoint (save it with save_pretrained(), safetensors)'


class UnsupportedArchitectureError(QuantyardError, ValueError):
    code = "unsupported_architecture"
    default_hint = 'convert a checkpoint of a supported architecture'

    def __init__(self, message: str, *, supported: list[str], hint: str | None = None) -> None:
        self.supported = supported
        super().__init__(message, hint=hint)


class TokenizerUnsupportedError(QuantyardError, ValueError):
    """The checkpoint's tokenizer cannot be represented by the target format."""

    code = "tokenizer_unsupported"
    default_hint = 'use a checkpoint whose tokenizer the target format supports'


class TokenizerMismatchError(QuantyardError, ValueError):
    code = "tokenizer_mismatch"
    default_hint = 'fix the tokenizer files, or pass --allow-tokenizer-mismatch (recorded in the lineage)'

    def __init__(self, message: str, *, position: int, expected: list[int], found: list[int],
                 hint: str | None = None) -> None:
        self.position = position
        self.expected = expected
        self.found = found
        super().__init__(message, hint=hint)


class InvalidArtifactError(QuantyardError, ValueError):
    """A quantized file or folder (GGUF, AWQ, EXL2) is malformed."""

    code = "invalid_artifact"
    default_hint = 're-create or re-download the quantized files'


class UnsafeSourceError(QuantyardError, PermissionError):
    """Pickle weights, remote code, or paths escaping the source, refused by default."""

    code = "unsafe_source"
    default_hint = 'review the source; only override with the matching --allow/--trust flag if you trust it'


class UnknownQuantTypeError(QuantyardError, ValueError):
    code = "unknown_quant_type"
    default_hint = 'run `quantyard convert --help` for the list of types'

    def __init__(self, message: str, *, known: list[str], hint: str | None = None) -> None:
        self.known = known
        super().__init__(message, hint=hint)


class InvalidSpecError(QuantyardError, ValueError):
    code = "invalid_spec"
    default_hint = 'check the command line or recipe against `quantyard convert --help`'


class UnknownFormatError(QuantyardError, KeyError):
    code = "unknown_format"
    default_hint = 'use one of the formats or engines listed in the message'

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


# --- registry ------------------------------------------------------------------------------------


class RegistryError(QuantyardError, RuntimeError):
    code = "registry_error"
    default_hint = ("check the registry location (--registry / QUANTYARD_REGISTRY); "
                    "`quantyard registry verify` diagnoses it")


class RegistryPathError(RegistryError, NotADirectoryError):
    code = "registry_path"
    default_hint = 'point --registry / QUANTYARD_REGISTRY at a folder or a sqlite:/// or postgresql:// URI'


class NotFoundError(RegistryError, LookupError):
    code = "not_found"
    default_hint = 'list what exists with `quantyard models` and `quantyard variants MODEL`'


class IllegalTransitionError(RegistryError, ValueError):
    code = "illegal_transition"
    default_hint = 'see the allowed transitions in the message'


class IntegrityError(RegistryError, ValueError):
    """Bytes on disk do not match the digest the registry recorded."""

    code = "integrity_error"
    default_hint = 'run `quantyard registry verify --deep` to list damaged versions; restore or rebuild them'
    exit_code = EXIT_CHECK_FAILED


class InvalidReferenceError(QuantyardError, ValueError):
    code = "invalid_reference"
    default_hint = 'write references as MODEL/VARIANT[@VERSION|@ALIAS]'


class EXL2FormatError(QuantyardError, ValueError):
    """EXL2 tensors that do not follow exllamav2's layout (bad groups, sizes, codes or permutation)."""

    code = "exl2_format"


# --- running tools -------------------------------------------------------------------------------


class ToolchainMissingError(QuantyardError, FileNotFoundError):
    """A tool Quantyard drives (llama.cpp converter, a managed env) is not installed."""

    code = "toolchain_missing"
    default_hint = 'run `make setup` (or `quantyard env ensure NAME`)'


class EnvironmentBuildError(QuantyardError, RuntimeError):
    """A managed tool environment could not be created, installed or checked."""

    code = "environment_build_failed"
    exit_code = EXIT_ENGINE

    def __init__(self, message: str, *, log: str = "", hint: str | None = None) -> None:
        self.stderr_tail = log
        super().__init__(message, hint=hint)


class ConversionError(QuantyardError, RuntimeError):
    code = "conversion_failed"
    default_hint = 'read the tool log named in the message'
    exit_code = EXIT_ENGINE

    def __init__(self, message: str, *, stderr_tail: str = "", hint: str | None = None) -> None:
        self.stderr_tail = stderr_tail
        super().__init__(message, hint=hint)


class EngineError(QuantyardError, RuntimeError):
    """An inference engine runner crashed, ran out of memory, timed out or answered garbage."""

    code = "engine_error"
    default_hint = 'read the runner log named in the message; other variants are unaffected'
    exit_code = EXIT_ENGINE

    def __init__(self, message: str, *, engine: str, returncode: int | None = None,
                 stderr_tail: str = "", hint: str | None = None) -> None:
        self.engine = engine
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        super().__init__(message, hint=hint)


class StageError(QuantyardError, RuntimeError):
    """A stage of a distributed run (a Prefect deployment run by a worker) failed, or finished without
    recording its output in the registry's stage ledger."""

    code = "stage_failed"
    exit_code = EXIT_ENGINE
    default_hint = ("see the stage's flow run in the Prefect UI (its logs name the error), then run the "
                    "orchestration again: finished stages are reused")


class OrchestratorError(QuantyardError, RuntimeError):
    """Prefect's embedded server, started for a run of this process (flows/embedded.py), failed to start."""

    code = "orchestrator_error"
    exit_code = EXIT_ENGINE
    default_hint = "read the server's log named in the message; or set PREFECT_API_URL to a running Prefect server"


class DiskFullError(QuantyardError, OSError):
    code = "disk_full"

    def __init__(self, path: Path | str, *, needed: int | None = None, free: int | None = None,
                 what: str | None = None, hint: str | None = None) -> None:
        """``what``: what would not fit, where it is known before writing (the message then says "would not
        fit" rather than "disk full while writing"); ``hint``: a more specific remedy than freeing space."""
        self.path = str(path)
        self.needed = needed
        self.free = free
        need = f"{needed / 1e6:.1f} MB" if needed is not None else "more space"
        have = f"; {free / 1e6:.1f} MB free" if free is not None else ""
        message = (f"{what} would not fit in {self.path}: it needs {need}{have}" if what
                   else f"disk full while writing {self.path}: needed {need}{have}")
        super().__init__(
            message,
            hint=hint or "free space on that filesystem or point QUANTYARD_WORK_DIR / --registry elsewhere, "
                         "then re-run: finished steps are reused",
        )


class InsufficientMemoryError(QuantyardError, MemoryError):
    """A piece of work whose ESTIMATED peak memory exceeds what this machine has available, refused before any
    work (flows/preflight.py). ``needed`` and ``available`` in bytes."""

    code = "insufficient_memory"
    default_hint = "use a machine with more memory, or the options the message names"

    def __init__(self, detail: str, *, needed: int, available: int, hint: str | None = None) -> None:
        self.needed, self.available = needed, available
        super().__init__(f"not enough memory, refused before any work: {detail}", hint=hint)


class WorkInUseError(QuantyardError, RuntimeError):
    """``quantyard work prune`` found the work folder leased by a running job (pipeline/workdir.py)."""

    code = "work_in_use"

    def __init__(self, root: Path | str) -> None:
        self.root = str(root)
        super().__init__(
            f"the work folder {self.root} is in use: a running Quantyard job (a convert flow, a stage on a worker "
            "or a validation) holds its lease, so nothing was pruned",
            hint="prune again once those jobs have finished (`--dry-run` lists what would go, meanwhile)")


class ConfigError(QuantyardError, ValueError):
    code = "config_error"
    default_hint = 'fix the setting or file named in the message'
