"""Recipes: one YAML file that says what to build from which sources, how to evaluate it, what counts as
good enough, and (for distributed runs) which work pool runs which stage.

The same file drives ``quantyard convert --recipe`` (one process), ``quantyard orchestrate`` (stages as
Prefect deployments on CPU and GPU work pools) and ``quantyard watch`` (a scheduled deployment that
rebuilds when a source's commit changes). Example::

    name: demo                      # model name in the registry (one source)
    source: ./demo-checkpoint       # a folder (relative to this file) or a hub id OWNER/NAME
    revision: main                  # hub branch, tag or commit
    formats:
      gguf: {types: [Q8_0, Q4_K_M]}
      awq: {bits: 4, group_size: 128}
      exl2: {bpw: [4.0, 6.0]}
    eval: {max_windows: 16, speed: false}
    policy: {classes: {Q4: {max_kld: 0.03}}, promote: true}
    placement: {reference: gpu, engines: {llama.cpp: cpu}}

Several sources share one recipe with ``sources: [{source: a/b, name: b}, ...]``. Every key is checked:
an unknown or misspelt key is an error that names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ConfigDict, Field, ValidationError, model_validator

from pipeline.errors import ConfigError, InvalidSpecError
from pipeline.formats import Pool, VariantSpec, format_info
from pipeline.plan import (
    CalibrationSpec,
    EvalSpec,
    GGUFOptions,
    Plan,
    ServingSpec,
    SourceInput,
    SpeedSpec,
    awq_options,
    parse_gguf_base,
    parse_split_size,
    reference_on_gpu,
    variants_from_flags,
)
from pipeline.policy import Policy, QualityLimits, build_policy
from pipeline.specs import EXL2Spec, Frozen


class GGUFRecipe(Frozen):
    types: tuple[str, ...] = Field(min_length=1)
    imatrix: bool = False
    base: str = "auto"
    split_max_size: str | None = None
    calibration: str | None = None  # imatrix calibration text (a file, relative to the recipe)
    imatrix_chunks: int | None = Field(default=None, ge=1)
    allow_tokenizer_mismatch: bool = False


class AWQRecipe(Frozen):
    backend: str = "llmcompressor"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    calibration: str | None = None  # a file (relative to the recipe) or dataset:NAME[:CONFIG]:SPLIT[:COLUMN]
    calibration_samples: int = 64
    calibration_seq_len: int = 256


class EXL2Recipe(Frozen):
    """``bpw`` is the list of targets; any other key is an :class:`EXL2Spec` field (``head_bits``...)."""

    model_config = ConfigDict(frozen=True, extra="allow")
    bpw: tuple[float, ...] = Field(min_length=1)


class Formats(Frozen):
    gguf: GGUFRecipe | None = None
    awq: AWQRecipe | None = None
    exl2: EXL2Recipe | None = None


class SourceEntry(Frozen):
    source: str
    revision: str | None = None
    name: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False


class RecipePolicy(Frozen):
    """Quality limits (as in ``quantyard validate --policy``) checked after evaluation; ``promote`` moves
    every passing new version from candidate to validated."""

    classes: dict[str, QualityLimits] = Field(default_factory=dict)
    types: dict[str, QualityLimits] = Field(default_factory=dict)
    overrides: dict[str, QualityLimits] = Field(default_factory=dict)
    promote: bool = False

    def policy(self) -> Policy:
        return build_policy(self.classes, self.types, self.overrides)


class Placement(Frozen):
    """Which logical work pool (``cpu`` or ``gpu``) runs each stage of a distributed run."""

    resolve: Pool = "cpu"
    registration: Pool = "cpu"
    reference: Pool | None = None  # default: gpu when eval.reference_device is cuda* or auto (GPUs), else cpu
    formats: dict[str, Pool] = Field(default_factory=dict)
    engines: dict[str, Pool] = Field(default_factory=dict)

    def for_format(self, fmt: str) -> Pool:
        """The recipe's pool for ``fmt``'s conversion, else the format's own (FormatInfo.pool).

        Raises UnknownFormatError for an unknown format."""
        return self.formats.get(fmt, format_info(fmt).pool)

    def for_engine(self, engine: str, default: Pool) -> Pool:
        """The recipe's pool for evaluations on ``engine``, else ``default`` (the engine's EngineInfo.pool)."""
        return self.engines.get(engine, default)

    def for_reference(self, spec: EvalSpec) -> Pool:
        if self.reference is not None:
            return self.reference
        return "gpu" if reference_on_gpu(spec.reference_device or "cpu") else "cpu"


class Recipe(Frozen):
    name: str | None = None
    source: str | None = None
    revision: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False
    sources: tuple[SourceEntry, ...] = ()
    formats: Formats
    eval: dict[str, Any] = Field(default_factory=dict)  # EvalSpec fields; ``speed: false`` turns speed off
    #: ServingSpec fields (``serving: {users: [1, 8, 32, 64]}``; ``serving: true`` for the defaults)
    serving: dict[str, Any] | bool = False
    force: bool = False
    policy: RecipePolicy | None = None
    placement: Placement = Placement()

    @model_validator(mode="after")
    def _one_kind_of_source(self) -> Recipe:
        if bool(self.source) == bool(self.sources):
            raise ValueError("give either `source` (one source) or `sources` (a list), not both and not neither")
        if self.sources and (self.name or self.revision):
            raise ValueError("with `sources`, put name and revision in each entry")
        return self

    def entries(self) -> list[SourceEntry]:
        if self.sources:
            return list(self.sources)
        assert self.source is not None
        return [SourceEntry(source=self.source, revision=self.revision, name=self.name,
                            allow_pickle=self.allow_pickle, trust_remote_code=self.trust_remote_code)]


def _relative(value: str | None, base: Path) -> str | None:
    """A path written in a recipe, resolved against the recipe's folder (absolute and ~ paths kept)."""
    if value is None or value.startswith("dataset:"):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def _source_text(value: str, base: Path) -> str:
    """A local folder relative to the recipe becomes absolute; anything else (a hub id) is kept."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    candidate = base / path
    return str(candidate.resolve()) if candidate.exists() or value.startswith((".", "/")) else value


def _variants(formats: Formats, base: Path) -> tuple[VariantSpec, ...]:
    specs: list[VariantSpec] = []
    if formats.gguf:
        specs.extend(variants_from_flags(gguf=",".join(formats.gguf.types), imatrix=formats.gguf.imatrix))
    if formats.awq:
        a = formats.awq
        opts = awq_options(a.bits, a.group_size, a.symmetric, _relative(a.calibration, base), a.calibration_samples,
                           a.calibration_seq_len)
        specs.extend(variants_from_flags(awq=True, awq_backend=a.backend, awq_opts=opts))
    if formats.exl2:
        extra = dict(formats.exl2.model_extra or {})
        for bpw in formats.exl2.bpw:
            try:
                specs.append(EXL2Spec(bpw=bpw, **extra))
            except ValidationError as exc:
                raise InvalidSpecError(f"invalid EXL2 settings in the recipe: {exc}",
                                       hint="formats.exl2 takes bpw: [..] and EXL2 options such as head_bits") from exc
    if not specs:
        raise InvalidSpecError("the recipe asks for no variants",
                               hint="add formats.gguf.types, formats.awq and/or formats.exl2.bpw")
    seen: dict[str, VariantSpec] = {}
    for spec in specs:
        seen.setdefault(spec.name, spec)
    return tuple(seen.values())


def eval_spec(data: dict[str, Any], base: Path) -> EvalSpec:
    """EvalSpec from the recipe's ``eval`` mapping (``speed: false`` is short for ``speed: {enabled: false}``)."""
    values = dict(data)
    speed = values.pop("speed", None)
    if isinstance(speed, bool):
        values["speed"] = SpeedSpec(enabled=speed)
    elif speed is not None:
        values["speed"] = speed
    if values.get("text_file"):
        values["text_file"] = _relative(str(values["text_file"]), base)
    return EvalSpec.model_validate(values)


def _plan(recipe: Recipe, entry: SourceEntry, base: Path) -> Plan:
    gguf = recipe.formats.gguf
    options = GGUFOptions() if gguf is None else GGUFOptions(
        base_type=parse_gguf_base(gguf.base), split_max_size=parse_split_size(gguf.split_max_size),
        calibration=CalibrationSpec(file=_relative(gguf.calibration, base), chunks=gguf.imatrix_chunks),
        allow_tokenizer_mismatch=gguf.allow_tokenizer_mismatch)
    return Plan(
        source=SourceInput(source=_source_text(entry.source, base), revision=entry.revision,
                           allow_pickle=entry.allow_pickle, trust_remote_code=entry.trust_remote_code),
        model_name=entry.name, variants=_variants(recipe.formats, base), eval=eval_spec(recipe.eval, base),
        serving=serving_spec(recipe.serving), force=recipe.force, gguf=options)


def serving_spec(data: dict[str, Any] | bool) -> ServingSpec:
    """ServingSpec from the recipe's ``serving`` (a mapping of its fields, or ``true`` for the defaults)."""
    if isinstance(data, bool):
        return ServingSpec(enabled=data)
    return ServingSpec.model_validate({"enabled": True, **data})


def parse_recipe(data: Any, base: Path) -> tuple[Recipe, list[Plan]]:
    """Validate a recipe mapping; return it with one :class:`Plan` per source.

    Raises:
        ConfigError: a key is unknown or a value is invalid (the message names it).
        InvalidSpecError / UnknownQuantTypeError: a variant cannot be built as written.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"a recipe must be a mapping, found {type(data).__name__}",
                          hint="see the example at the top of pipeline/recipe.py or docs/distributed.md")
    try:
        recipe = Recipe.model_validate(data)
        plans = [_plan(recipe, entry, base) for entry in recipe.entries()]
    except ValidationError as exc:
        raise ConfigError(f"invalid recipe: {_first_errors(exc)}",
                          hint="fix the key named above; keys: name, source, revision, sources, formats, eval, "
                               "force, policy, placement") from exc
    return recipe, plans


def _first_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "recipe"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def load_recipe_file(path: Path) -> tuple[Recipe, list[Plan]]:
    """Read and validate a YAML recipe (relative paths in it are relative to its folder)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc}", hint="pass a readable YAML file") from exc
    return parse_recipe(data, path.resolve().parent)
