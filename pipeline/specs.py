"""Domain types: formats, engines, quant types, sources and variant specs.

Closed sets are enums. Variant specs are a discriminated union on ``format``.
Every model here is frozen and forbids unknown fields, so a typo in a recipe or
a JSON request is an error rather than a silently ignored setting.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from typing import Any, Literal

import gguf
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.errors import InvalidSpecError, UnknownQuantTypeError


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class QuantFormat(enum.StrEnum):
    GGUF = "gguf"
    AWQ = "awq"
    EXL2 = "exl2"


class Engine(enum.StrEnum):
    """Inference engines a variant can be evaluated on."""

    LLAMA_CPP = "llama.cpp"
    VLLM = "vllm"
    EXLLAMAV2 = "exllamav2"
    EXL2_REFERENCE = "exl2-reference"
    TRANSFORMERS = "transformers"


def _gguf_file_types() -> dict[str, int]:
    """llama.cpp file types by their llama-quantize name, taken from gguf-py (never pasted here)."""
    out: dict[str, int] = {}
    for member in gguf.LlamaFileType:
        if member.name == "GUESSED":
            continue
        name = re.sub(r"^(MOSTLY|ALL)_", "", member.name)
        out[name] = int(member.value)
    return out


#: Every llama.cpp file type, named as ``llama-quantize`` names it (``Q4_K_M``, ``IQ4_XS``, ``BF16``...).
GGUFType = enum.IntEnum("GGUFType", _gguf_file_types())  # type: ignore[misc]

#: Types that llama.cpp can only produce well with an importance matrix. Quantyard requires one for
#: every IQ type (stricter than llama-quantize, which only refuses the 1- and 2-bit ones).
IMATRIX_REQUIRED_PREFIXES = ("IQ1", "IQ2", "IQ3", "IQ4", "Q2_K_S")

#: File types the HF->GGUF converter writes directly (the "base"); everything else is quantized from it.
GGUF_BASE_TYPES = ("F16", "BF16", "F32")


def parse_gguf_type(name: str) -> Any:
    """Return the :data:`GGUFType` member for a llama-quantize type name (case-insensitive).

    Raises:
        UnknownQuantTypeError: the name is not a llama.cpp file type; the error lists the known ones.
    """
    key = name.strip().upper()
    try:
        return GGUFType[key]
    except KeyError:
        known = [m.name for m in GGUFType]
        raise UnknownQuantTypeError(
            f"unknown GGUF type {name!r}: expected one of llama.cpp's file types",
            known=known,
            hint="choose from: " + ", ".join(known),
        ) from None


def gguf_type_names() -> list[str]:
    return [m.name for m in GGUFType]


def bits_class(bits: int) -> str:
    """The quality class of a whole number of bits per weight: 1 and 2 → Q2, 3 → Q3 … 6 → Q6, 7 and 8 → Q8."""
    if bits <= 2:
        return "Q2"
    return f"Q{bits}" if bits <= 6 else "Q8"


class AWQBackend(enum.StrEnum):
    LLMCOMPRESSOR = "llmcompressor"
    AUTOAWQ = "autoawq"


class EXL2Backend(enum.StrEnum):
    EXLLAMAV2 = "exllamav2"
    REFERENCE_CPU = "reference-cpu"


class GGUFSpec(Frozen):
    format: Literal[QuantFormat.GGUF] = QuantFormat.GGUF
    type: str
    imatrix: bool = False

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        return parse_gguf_type(value).name

    @property
    def file_type(self) -> int:
        return int(GGUFType[self.type])

    @property
    def name(self) -> str:
        # "i1-" marks imatrix quants, as mradermacher's i1 repos do.
        return f"i1-{self.type}" if self.imatrix else self.type

    @property
    def is_base(self) -> bool:
        return self.type in GGUF_BASE_TYPES

    @property
    def requires_imatrix(self) -> bool:
        return self.type.startswith(IMATRIX_REQUIRED_PREFIXES)

    @property
    def quant_class(self) -> str:
        """The quality class of :mod:`pipeline.policy` (F16, Q8, Q6, Q5, Q4, Q3, Q2) by the type's leading bits."""
        if self.is_base:
            return "F16"
        m = re.match(r"^(?:I?Q|TQ|MXFP|NVFP)(\d)", self.type)
        if m is None:
            raise InvalidSpecError(f"GGUF type {self.type} has no quality class: expected a name such as Q4_K_M, "
                                   "IQ3_S, TQ1_0 or MXFP4_MOE", hint="add it to policy overrides by variant name")
        return bits_class(int(m.group(1)))


class AWQSpec(Frozen):
    """A weight-only AWQ variant (activations stay 16/32-bit).

    ``calibration`` is a text file, ``dataset:NAME[:CONFIG]:SPLIT[:COLUMN]`` (needs the optional
    ``datasets`` package), or None for the bundled calibration text (the checkpoint's
    ``calibration.txt``, else the built-in held-out calibration split; never the evaluation text).
    ``calibration_sha256`` pins a calibration file's content (filled when the plan is made), so a
    changed file gives a new build key. ``calibration_samples`` samples of ``calibration_seq_len``
    tokens are cut from the tokenized text.
    """

    format: Literal[QuantFormat.AWQ] = QuantFormat.AWQ
    bits: Literal[4, 8] = 4
    group_size: int = 128
    symmetric: bool = False
    backend: AWQBackend = AWQBackend.LLMCOMPRESSOR
    calibration: str | None = None
    calibration_sha256: str | None = None
    calibration_samples: int = Field(default=64, ge=1, le=4096)
    calibration_seq_len: int = Field(default=256, ge=16, le=32768)

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        if value != -1 and (value < 16 or value & (value - 1)):
            raise InvalidSpecError(f"AWQ group size must be a power of two >= 16 (or -1 for per-channel), got {value}")
        return value

    @property
    def quant_class(self) -> str:
        return bits_class(self.bits)

    @property
    def name(self) -> str:
        sym = "sym" if self.symmetric else "asym"
        suffix = "" if self.backend == AWQBackend.LLMCOMPRESSOR else "-gemm"
        return f"AWQ-W{self.bits}-G{self.group_size}-{sym}{suffix}"


class EXL2Spec(Frozen):
    """An EXL2 variant. ``backend`` None means "exllamav2 where it can run (CUDA), else reference-cpu";
    flows resolve it before computing build keys, so a registered spec always names its backend."""

    format: Literal[QuantFormat.EXL2] = QuantFormat.EXL2
    bpw: float = Field(ge=2.0, le=8.0)
    head_bits: int = 6
    backend: EXL2Backend | None = None

    @field_validator("head_bits")
    @classmethod
    def _head_bits(cls, value: int) -> int:
        if value not in (2, 3, 4, 5, 6, 8):
            raise InvalidSpecError(f"EXL2 head bits must be one of 2,3,4,5,6,8, got {value}")
        return value

    @property
    def quant_class(self) -> str:
        """By bits per weight: 7.5 and up Q8, 5.5 Q6, 4.5 Q5, 3.5 Q4, 2.5 Q3, below Q2."""
        for cls, floor in (("Q8", 7.5), ("Q6", 5.5), ("Q5", 4.5), ("Q4", 3.5), ("Q3", 2.5)):
            if self.bpw >= floor:
                return cls
        return "Q2"

    @property
    def hub_revision(self) -> str:
        """The Hub branch of this variant in a published EXL2 repo, as exllamav2 repos name them: ``4.0bpw``."""
        text = f"{self.bpw:.2f}".rstrip("0")
        return f"{text}0bpw" if text.endswith(".") else f"{text}bpw"

    @property
    def name(self) -> str:
        """``EXL2-4.0bpw``; ``-h8`` for non-default head bits; ``-ref`` when built by the reference-cpu
        backend (so its files are never mistaken for exllamav2's own conversion)."""
        text = f"{self.bpw:.2f}".rstrip("0")
        name = f"EXL2-{text}0bpw" if text.endswith(".") else f"EXL2-{text}bpw"
        if self.head_bits != 6:
            name += f"-h{self.head_bits}"
        return name + ("-ref" if self.backend == EXL2Backend.REFERENCE_CPU else "")


def spec_digest(spec: BaseModel) -> str:
    """A stable sha256 of a spec's canonical JSON (sorted keys)."""
    payload = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


class SourceKind(enum.StrEnum):
    HUB = "hub"
    LOCAL = "local"


class SourceRef(Frozen):
    """A resolved, immutable reference to a checkpoint.

    A hub source is pinned by its commit SHA; a local folder by a content hash of its files.
    ``path`` is where the files are on this machine (the snapshot folder for a hub source).
    """

    kind: SourceKind
    path: str
    content_hash: str | None = None
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def identity(self) -> str:
        if self.kind == SourceKind.HUB:
            return f"hub:{self.repo_id}@{self.commit}"
        return f"local:sha256:{self.content_hash}"

    @property
    def short(self) -> str:
        if self.kind == SourceKind.HUB:
            return f"{self.repo_id}@{(self.commit or '')[:12]}"
        return f"sha256:{(self.content_hash or '')[:12]}"


class VersionState(enum.StrEnum):
    CANDIDATE = "candidate"
    VALIDATED = "validated"
    PUBLISHED = "published"
    REJECTED = "rejected"
    DEPRECATED = "deprecated"


#: Legal state transitions of a registry version; anything else raises IllegalTransitionError.
VERSION_TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    VersionState.CANDIDATE: frozenset({VersionState.VALIDATED, VersionState.REJECTED}),
    VersionState.VALIDATED: frozenset({VersionState.PUBLISHED, VersionState.REJECTED, VersionState.DEPRECATED}),
    VersionState.PUBLISHED: frozenset({VersionState.DEPRECATED}),
    VersionState.REJECTED: frozenset(),
    VersionState.DEPRECATED: frozenset(),
}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9][A-Za-z0-9._\-]*)?$")
_VARIANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


def validate_model_name(name: str) -> str:
    """Model names look like hub ids: ``name`` or ``owner/name`` (letters, digits, ``.``, ``_``, ``-``)."""
    if not _NAME_RE.match(name) or ".." in name:
        raise InvalidSpecError(
            f"invalid model name {name!r}: expected 'name' or 'owner/name' using letters, digits, '.', '_', '-'",
            hint="pass --name with a valid name",
        )
    return name


class Ref(Frozen):
    """A registry reference: ``MODEL/VARIANT[@VERSION|@ALIAS]`` (MODEL may itself be ``owner/name``)."""

    model: str
    variant: str
    version: int | None = None
    alias: str | None = None

    @classmethod
    def parse(cls, text: str) -> Ref:
        from pipeline.errors import InvalidReferenceError

        body, at, selector = text.partition("@")
        model, sep, variant = body.rpartition("/")
        if not sep or not model or not _VARIANT_RE.match(variant) or not _NAME_RE.match(model):
            raise InvalidReferenceError(
                f"invalid reference {text!r}: expected MODEL/VARIANT[@VERSION|@ALIAS], e.g. demo/Q4_K_M@1",
                hint="list references with `quantyard variants MODEL`",
            )
        if not at:
            return cls(model=model, variant=variant)
        if not selector:
            raise InvalidReferenceError(f"invalid reference {text!r}: empty version after '@'")
        if selector.isdigit():
            return cls(model=model, variant=variant, version=int(selector))
        if not _VARIANT_RE.match(selector):
            raise InvalidReferenceError(f"invalid version or alias {selector!r} in {text!r}")
        return cls(model=model, variant=variant, alias=selector)

    def __str__(self) -> str:
        sel = f"@{self.version}" if self.version is not None else f"@{self.alias}" if self.alias else ""
        return f"{self.model}/{self.variant}{sel}"
