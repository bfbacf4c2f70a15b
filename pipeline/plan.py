"""The Plan: everything a conversion run will do, validated before any work starts.

CLI flags, recipe files and flow parameters all become a :class:`Plan`; flows and
tasks receive the plan (JSON-serialisable), never loose arguments.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from pipeline.errors import ConfigError, InvalidSpecError
from pipeline.specs import (
    AWQBackend,
    AWQSpec,
    EXL2Backend,
    EXL2Spec,
    Frozen,
    GGUFSpec,
    VariantSpec,
    parse_gguf_type,
)


class SpeedSpec(Frozen):
    enabled: bool = True
    repeats: int = Field(default=3, ge=1)
    prompt_tokens: int = Field(default=512, ge=8)
    gen_tokens: int = Field(default=128, ge=1)
    parallel: tuple[int, ...] = (1, 8, 32)
    parallel_prompt_tokens: int = Field(default=128, ge=1)
    parallel_gen_tokens: int = Field(default=64, ge=1)


class EvalSpec(Frozen):
    enabled: bool = True
    text_file: str | None = None  # default: the demo's held-out text, or a file named by the recipe
    dataset: str | None = None  # "name[:config]:split[:column]" via the optional datasets package
    window: int = Field(default=512, ge=16)
    stride: int = Field(default=512, ge=1)
    max_windows: int | None = Field(default=None, ge=1)
    top_k: int = Field(default=32, ge=1, le=1024)
    reference_dtype: str = "float32"
    reference_device: str = "cpu"
    speed: SpeedSpec = SpeedSpec()


class SourceInput(Frozen):
    """What the user typed for the source, before resolution."""

    source: str
    revision: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False


class Plan(Frozen):
    source: SourceInput
    model_name: str | None = None
    variants: tuple[VariantSpec, ...]
    eval: EvalSpec = EvalSpec()
    force: bool = False
    gguf_base_type: str = "auto"

    def by_format(self) -> dict[str, list[VariantSpec]]:
        out: dict[str, list[VariantSpec]] = {}
        for spec in self.variants:
            out.setdefault(spec.format.value, []).append(spec)
        return out


def split_list(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def variants_from_flags(gguf: str | None = None, awq: bool = False, awq_backend: str = "llmcompressor",
                        exl2: str | None = None, imatrix: bool = False, exl2_backend: str = "auto",
                        exl2_head_bits: int = 6) -> tuple[VariantSpec, ...]:
    """Turn ``--gguf Q8_0,Q4_K_M --awq --exl2 4.0,6.0`` into variant specs (validated, de-duplicated)."""
    specs: list[VariantSpec] = [GGUFSpec(type=parse_gguf_type(t).name, imatrix=imatrix) for t in split_list(gguf)]
    if awq:
        specs.append(AWQSpec(backend=AWQBackend(awq_backend)))
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


def _exl2_backend(name: str) -> EXL2Backend | None:
    if name == "auto":
        return None
    try:
        return EXL2Backend(name)
    except ValueError:
        known = ", ".join(["auto", *(b.value for b in EXL2Backend)])
        raise InvalidSpecError(f"unknown EXL2 backend {name!r}: expected one of {known}") from None


def load_recipe(path: Path) -> dict[str, object]:
    """Read a YAML recipe (same keys as :class:`Plan`)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping, found {type(data).__name__}")
    return data


def plan_from_recipe(data: dict[str, object]) -> Plan:
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid recipe: {exc}") from exc
