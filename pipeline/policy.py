"""Validation policy: quality thresholds per quant class, speed regression limits.

The default KLD limits follow the bands llama.cpp's ``--kl-divergence`` tables show for Llama-class
models (Q8 ≈ 0.002, Q6 ≈ 0.01, Q5 ≈ 0.02, Q4 ≈ 0.05, Q3 ≈ 0.15, Q2 ≈ 0.5 mean KLD). They are
**defaults to tune** for your models and evaluation text: small models and code-heavy text shift
them. ΔPPL and top-1 limits are looser companions derived the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from pipeline.errors import ConfigError, InvalidSpecError
from pipeline.formats import parse_variant_spec
from pipeline.specs import Frozen

#: The checks of :class:`QualityLimits`: (metric of a quality result, limit field, the limit is a maximum).
QUALITY_CHECKS: tuple[tuple[str, str, bool], ...] = (
    ("kld_mean", "max_kld", True), ("delta_ppl_pct", "max_delta_ppl_pct", True), ("top1_agreement", "min_top1", False))


class QualityLimits(Frozen):
    max_kld: float | None = Field(default=None, ge=0)
    max_delta_ppl_pct: float | None = None
    min_top1: float | None = Field(default=None, ge=0, le=1)

    def problems(self, quality: Mapping[str, Any]) -> list[str]:
        """What in ``quality`` (a quality result's metrics) breaks these limits, one line each. The one
        quality check of Quantyard (``validate`` and a recipe's policy both use it): a metric that a set
        limit needs but ``quality`` lacks is a problem too, so a gate never passes on a missing number."""
        out = []
        for metric, field, is_max in QUALITY_CHECKS:
            bound, value = getattr(self, field), quality.get(metric)
            if bound is None:
                continue
            if value is None:
                out.append(f"{metric} missing (needed by {field} {bound:.6g})")
            elif (value > bound) if is_max else (value < bound):
                out.append(f"{metric} {value:.6g} {'>' if is_max else '<'} {field} {bound:.6g}")
        return out


DEFAULT_CLASSES: dict[str, QualityLimits] = {
    "F16": QualityLimits(max_kld=0.0005, max_delta_ppl_pct=0.2, min_top1=0.98),
    "Q8": QualityLimits(max_kld=0.002, max_delta_ppl_pct=0.5, min_top1=0.95),
    "Q6": QualityLimits(max_kld=0.01, max_delta_ppl_pct=1.0, min_top1=0.92),
    "Q5": QualityLimits(max_kld=0.02, max_delta_ppl_pct=2.0, min_top1=0.90),
    "Q4": QualityLimits(max_kld=0.05, max_delta_ppl_pct=5.0, min_top1=0.85),
    "Q3": QualityLimits(max_kld=0.15, max_delta_ppl_pct=15.0, min_top1=0.78),
    "Q2": QualityLimits(max_kld=0.5, max_delta_ppl_pct=50.0, min_top1=0.60),
}


class SpeedLimits(Frozen):
    max_slowdown_pct: float = Field(default=10.0, ge=0)
    metrics: tuple[str, ...] = ("prompt_tok_per_s", "decode_tok_per_s")


class Policy(Frozen):
    classes: dict[str, QualityLimits] = Field(default_factory=lambda: dict(DEFAULT_CLASSES))
    overrides: dict[str, QualityLimits] = Field(default_factory=dict)  # by variant name, e.g. "Q4_K_M"
    speed: SpeedLimits = SpeedLimits()

    def limits_for(self, variant: str, quant_class: str) -> QualityLimits:
        if variant in self.overrides:
            return self.overrides[variant]
        if quant_class not in self.classes:
            raise ConfigError(f"policy has no limits for quant class {quant_class!r}",
                              hint=f"add classes.{quant_class} to the policy file")
        return self.classes[quant_class]


def quant_class(fmt: str, spec: dict[str, Any]) -> str:
    """A variant's quality class (F16, Q8, Q6, Q5, Q4, Q3 or Q2), from its format's spec model.

    Raises:
        UnknownFormatError: ``fmt`` is not a known format.
        InvalidSpecError: the spec is not valid for its format, or its type has no class.
    """
    try:
        parsed = parse_variant_spec({**spec, "format": fmt})
    except ValidationError as exc:
        raise InvalidSpecError(f"cannot classify a {fmt} variant with spec {spec}: {exc}") from exc
    return str(parsed.quant_class)


def load_policy(path: Path | None) -> Policy:
    """The default policy, or a YAML file (keys: classes, overrides, speed) merged over it."""
    if path is None:
        return Policy()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read policy {path}: {exc}", hint="pass a readable YAML file") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"policy {path} must be a mapping")
    classes = dict(DEFAULT_CLASSES)
    for name, limits in (data.get("classes") or {}).items():
        base = classes.get(name, QualityLimits()).model_dump()
        classes[name] = QualityLimits(**{**base, **(limits or {})})
    try:
        overrides = {k: QualityLimits(**v) for k, v in (data.get("overrides") or {}).items()}
        return Policy(classes=classes, overrides=overrides, speed=SpeedLimits(**(data.get("speed") or {})))
    except (ValidationError, TypeError) as exc:
        raise ConfigError(f"invalid policy {path}: {exc}") from exc
