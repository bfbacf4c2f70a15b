"""Validation policy: quality thresholds per quant type and class, speed regression limits, a serving SLO.

The default limits are stated for the **exact** (full-vocabulary) mean KLD, the number
``llama-perplexity --kl-divergence`` prints and Quantyard's ``kld_mean`` is; a result computed in the
cheaper top-K mode has no ``kld_mean`` and so can never pass a ``max_kld`` gate.

Where they come from: llama.cpp's published tables in ``tools/perplexity/README.md`` of the pinned llama.cpp
(llama-cpp-python 0.3.36's vendored tree): the "LLaMA 3 8b Scoreboard" (KLD and ΔPPL of every type against
FP16 on Wikitext-2, 512-token chunks) and "LLaMA 2 vs. LLaMA 3 Quantization comparison" ("Same top p").
LLaMA 3 8B quantizes worse than LLaMA 2 7B, so its figures are used. Each limit is 1.25 × the published
figure (:data:`MARGIN`), rounded up to two significant digits:

* per GGUF type (:data:`PUBLISHED`, the row without an importance matrix where there is one, else the
  ``WT 10m`` row): ``max_kld`` and ``max_delta_ppl_pct`` (ΔPPL / PPL(FP16) = 6.233160);
* per class (F16, Q8 … Q2: AWQ, EXL2 and GGUF types not in the table): the largest figure among the
  class's types in the table, and ``min_top1`` from "Same top p" (q8_0 97.674 %, q6_K 96.031 %, q4_K_M
  91.901 %, q2_K 71.138 %; Q5 and Q3 take the next lower class's, F16 99 %) less 1.25 × its shortfall
  from 100 %, rounded down to a whole percent; a type takes its class's ``min_top1``.

They are **defaults to tune**: a 135 M-parameter model loses more to the same type than an 8 B one
(SmolLM2-135M's Q8_0 has an exact KLD of about 0.004, three times LLaMA 3 8B's), and text other than
Wikitext moves every figure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator

from pipeline.errors import ConfigError, InvalidSpecError
from pipeline.formats import parse_variant_spec
from pipeline.results import kld_of
from pipeline.shown import LLAMA_LINES
from pipeline.specs import Frozen, bits_class

#: The checks of :class:`QualityLimits`: (metric of a quality result, limit field, the limit is a maximum).
QUALITY_CHECKS: tuple[tuple[str, str, bool], ...] = (
    ("kld_mean", "max_kld", True), ("delta_ppl_pct", "max_delta_ppl_pct", True), ("top1_agreement", "min_top1", False),
    ("kld_p99", "max_kld_p99", True), ("kld_p999", "max_kld_p999", True), ("kld_max", "max_kld_max", True),
    ("delta_p_rms", "max_delta_p_rms", True))
#: The statistics ``max_stats`` / ``min_stats`` may limit: every one llama-perplexity prints (pipeline.shown).
STATISTICS = frozenset(key for _, key, _ in LLAMA_LINES)


def _exact_only(metric: str) -> bool:
    """A statistic of the exact KLD's distribution: a result without the exact KLD (a top-K bound) has none."""
    return metric.startswith("kld_")


class QualityLimits(Frozen):
    """Limits on a quality result. Beyond the mean KLD, ΔPPL and top-1, the tails of the exact KLD (its 99th and
    99.9th percentiles and maximum, as llama-perplexity prints them: Unsloth's comparisons rank by the 99.9 %) and
    the RMS of Δp (the change in the correct token's probability); none of these is set by default."""

    max_kld: float | None = Field(default=None, ge=0)
    max_delta_ppl_pct: float | None = None
    min_top1: float | None = Field(default=None, ge=0, le=1)
    max_kld_p99: float | None = Field(default=None, ge=0)
    max_kld_p999: float | None = Field(default=None, ge=0)
    max_kld_max: float | None = Field(default=None, ge=0)
    max_delta_p_rms: float | None = Field(default=None, ge=0, le=1)
    #: Any other of llama-perplexity's statistics (pipeline.shown.LLAMA_LINES keys, as stored: fractions, not
    #: percentages), e.g. ``{kld_p95: 0.2, delta_p_p01: -0.3}``: an upper limit each, or a lower one in
    #: ``min_stats``.
    max_stats: dict[str, float] = Field(default_factory=dict)
    min_stats: dict[str, float] = Field(default_factory=dict)

    @field_validator("max_stats", "min_stats")
    @classmethod
    def _known(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - STATISTICS)
        if unknown:
            raise ValueError(f"unknown statistic(s) {', '.join(unknown)}: expected some of "
                             f"{', '.join(sorted(STATISTICS))}")
        return value

    def problems(self, quality: Mapping[str, Any]) -> list[str]:
        """What in ``quality`` (a quality result's metrics) breaks these limits, one line each. The one
        quality check of Quantyard (``validate`` and a recipe's policy both use it): a metric that a set
        limit needs but ``quality`` lacks is a problem too, so a gate never passes on a missing number, and
        ``max_kld`` takes only the exact KLD (a top-K lower bound, or a result stored before exact KLD, is
        named as such and fails)."""
        out = []
        for metric, field, is_max, bound, value in self._pairs(quality):
            if value is None:
                out.append(self._missing(metric, field, bound, quality))
            elif (value > bound) if is_max else (value < bound):
                out.append(f"{metric} {value:.6g} {'>' if is_max else '<'} {field} {bound:.6g}")
        return out

    def lines(self, quality: Mapping[str, Any]) -> list[str]:
        """Every set limit beside the value it gates and the value's 95 % interval (the window bootstrap's,
        see evaluators.metrics), with ``inconclusive`` where the limit lies inside the interval: at this many
        windows the data cannot tell on which side of the limit the variant is."""
        out = []
        for metric, field, is_max, bound, value in self._pairs(quality):
            if value is None:
                out.append(self._missing(metric, field, bound, quality))
                continue
            ci = _ci(metric, quality)
            ok = value <= bound if is_max else value >= bound
            text = f"{metric} {value:.6g}" + (f" [95 % CI {ci[0]:.6g}–{ci[1]:.6g}]" if ci else "")
            text += f" {'≤' if is_max else '≥'} {bound:.6g}: {'ok' if ok else 'FAIL'}"
            if ci and ci[0] <= bound <= ci[1]:
                text += " (inconclusive: the limit lies inside the interval)"
            out.append(text)
        return out

    def _pairs(self, quality: Mapping[str, Any]) -> list[tuple[str, str, bool, float, float | None]]:
        out = []
        checks = [*((metric, field, is_max, getattr(self, field)) for metric, field, is_max in QUALITY_CHECKS),
                  *((key, f"max_stats.{key}", True, bound) for key, bound in self.max_stats.items()),
                  *((key, f"min_stats.{key}", False, bound) for key, bound in self.min_stats.items())]
        for metric, field, is_max, bound in checks:
            if bound is None:
                continue
            exact = kld_of(dict(quality)).exact
            if metric == "kld_mean":
                value = kld_of(dict(quality)).value if exact else None
            else:
                value = quality.get(metric) if exact or not _exact_only(metric) else None
            out.append((metric, field, is_max, bound, value))
        return out

    @staticmethod
    def _missing(metric: str, field: str, bound: float, quality: Mapping[str, Any]) -> str:
        if _exact_only(metric):
            kld = kld_of(dict(quality))
            if kld.value is not None and not kld.exact:
                return (f"{metric} missing: this result has only a {kld.method} ({kld.value:.6g}), and {field} "
                        f"{bound:.6g} is a limit on the exact full-vocabulary KLD; evaluate with the exact KLD")
        return f"{metric} missing (needed by {field} {bound:.6g})"


#: Where each gated metric's 95 % interval is (evaluators.metrics: window bootstrap).
_CI_KEYS = {"kld_mean": ("kld_ci95_low", "kld_ci95_high"),
            "delta_ppl_pct": ("delta_ppl_pct_ci95_low", "delta_ppl_pct_ci95_high"),
            "kld_p99": ("kld_p99_ci95_low", "kld_p99_ci95_high"),
            "kld_p999": ("kld_p999_ci95_low", "kld_p999_ci95_high")}


def _ci(metric: str, quality: Mapping[str, Any]) -> tuple[float, float] | None:
    keys = _CI_KEYS.get(metric)
    if keys is None:
        return None
    lo, hi = quality.get(keys[0]), quality.get(keys[1])
    return (float(lo), float(hi)) if isinstance(lo, int | float) and isinstance(hi, int | float) else None


#: Safety margin over a published figure (a limit is 1.25 × what llama.cpp measured on LLaMA 3 8B).
MARGIN = 1.25

#: llama.cpp's LLaMA 3 8B scoreboard (tools/perplexity/README.md): type → (mean KLD, ΔPPL as % of PPL(FP16)).
#: Rows without an importance matrix where the table has one; IQ types exist only with one (WT 10m).
PUBLISHED: dict[str, tuple[float, float]] = {
    "F16": (0.000551, 0.024), "Q8_0": (0.001355, 0.043), "Q6_K": (0.005452, 0.349),
    "Q5_K_M": (0.010762, 0.914), "Q5_K_S": (0.016595, 1.684), "Q5_1": (0.018045, 1.704), "Q5_0": (0.022239, 2.111),
    "Q4_K_M": (0.031273, 2.815), "Q4_K_S": (0.043136, 4.314), "IQ4_NL": (0.035742, 3.593),
    "IQ4_XS": (0.036334, 3.659), "Q4_1": (0.071683, 7.237), "Q4_0": (0.071940, 7.516),
    "Q3_K_L": (0.087176, 8.924), "Q3_K_M": (0.101913, 10.538), "Q3_K_S": (0.228217, 26.184),
    "IQ3_M": (0.102534, 10.696), "IQ3_S": (0.111278, 11.773), "IQ3_XS": (0.138693, 14.943),
    "IQ3_XXS": (0.183625, 19.680), "Q2_K": (0.445132, 56.469), "Q2_K_S": (0.403360, 49.607),
    "IQ2_M": (0.325989, 38.009), "IQ2_S": (0.439197, 54.854), "IQ2_XS": (0.546290, 72.672),
    "IQ2_XXS": (0.812022, 126.101),
}
#: "Same top p" of the LLaMA 2 vs. LLaMA 3 comparison (LLaMA 3 8B), per class; F16 from the scoreboard's f16
#: row has none published: 99 % (1.25 × the q8_0 shortfall would be 97.1 %, looser than q8_0 itself).
PUBLISHED_TOP1 = {"Q8": 0.97674, "Q6": 0.96031, "Q4": 0.91901, "Q2": 0.71138}


def _up(x: float) -> float:
    """Round up to two significant digits."""
    if x <= 0:
        return x
    exp = math.floor(math.log10(x)) - 1
    return float(f"{math.ceil(x / 10**exp - 1e-9) * 10**exp:.12g}")


def _type_limits(kld: float, dppl: float) -> QualityLimits:
    return QualityLimits(max_kld=_up(MARGIN * kld), max_delta_ppl_pct=_up(MARGIN * dppl))


def _class_of(name: str) -> str:
    """The class of a GGUF type name (F16, BF16, F32 → F16; else by its first digit, as GGUFSpec.quant_class)."""
    if name in ("F16", "BF16", "F32"):
        return "F16"
    digit = re.search(r"\d", name)
    return bits_class(int(digit.group())) if digit else "Q2"


def _class_limits() -> dict[str, QualityLimits]:
    out: dict[str, QualityLimits] = {}
    for cls in ("F16", "Q8", "Q6", "Q5", "Q4", "Q3", "Q2"):
        rows = [v for k, v in PUBLISHED.items() if _class_of(k) == cls]
        # classes without a published "Same top p" take the next lower class's (F16: 99 %, see above)
        top1 = PUBLISHED_TOP1.get(cls, {"F16": 0.99, "Q5": PUBLISHED_TOP1["Q4"], "Q3": PUBLISHED_TOP1["Q2"]}.get(cls))
        min_top1 = None if top1 is None else math.floor(100 * (1 - MARGIN * (1 - top1))) / 100
        limits = _type_limits(max(r[0] for r in rows), max(r[1] for r in rows))
        out[cls] = limits.model_copy(update={"min_top1": min_top1})
    return out


DEFAULT_CLASSES: dict[str, QualityLimits] = _class_limits()
DEFAULT_TYPES: dict[str, QualityLimits] = {
    name: _type_limits(kld, dppl).model_copy(update={"min_top1": DEFAULT_CLASSES[_class_of(name)].min_top1})
    for name, (kld, dppl) in PUBLISHED.items()}


class SpeedLimits(Frozen):
    max_slowdown_pct: float = Field(default=10.0, ge=0)
    metrics: tuple[str, ...] = ("prompt_tok_per_s", "decode_tok_per_s")


class ServingSLO(Frozen):
    """A serving SLO, gated by ``validate``'s serving check on the version's newest serving result with a
    closed-loop level at ``concurrency`` users (flows/serving_gate.py). Latencies in milliseconds, as
    :mod:`pipeline.serving` defines them (``vllm bench serve``'s names): p99 time to first token, p99
    inter-token latency, p99 time per output token; ``min_output_throughput`` in output tokens per second over
    the level. ``max_failed_pct``: failed requests allowed, in percent of the level's requests (their latencies
    are not in the percentiles, so by default none is allowed)."""

    concurrency: int = Field(ge=1)
    p99_ttft_ms: float | None = Field(default=None, gt=0)
    p99_itl_ms: float | None = Field(default=None, gt=0)
    p99_tpot_ms: float | None = Field(default=None, gt=0)
    min_output_throughput: float | None = Field(default=None, gt=0)
    max_failed_pct: float = Field(default=0.0, ge=0, le=100)


class Policy(Frozen):
    classes: dict[str, QualityLimits] = Field(default_factory=lambda: dict(DEFAULT_CLASSES))
    types: dict[str, QualityLimits] = Field(default_factory=lambda: dict(DEFAULT_TYPES))  # by GGUF type
    overrides: dict[str, QualityLimits] = Field(default_factory=dict)  # by variant name, e.g. "Q4_K_M"
    speed: SpeedLimits = SpeedLimits()
    serving: ServingSLO | None = None  # no serving check unless the policy file sets one

    def limits_for(self, variant: str, quant_class: str, quant_type: str | None = None) -> QualityLimits:
        """The limits of a variant: its override by name, else its GGUF type's (``quant_type``), else its
        class's.

        Raises:
            ConfigError: no limits for the class.
        """
        if variant in self.overrides:
            return self.overrides[variant]
        if quant_type is not None and quant_type.upper() in self.types:
            return self.types[quant_type.upper()]
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
    """The default policy, or a YAML file (keys: classes, types, overrides, speed, serving) merged over it
    (:func:`build_policy`)."""
    if path is None:
        return Policy()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read policy {path}: {exc}", hint="pass a readable YAML file") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"policy {path} must be a mapping")
    try:
        user_classes = {k: QualityLimits(**(v or {})) for k, v in (data.get("classes") or {}).items()}
        user_types = {k: QualityLimits(**(v or {})) for k, v in (data.get("types") or {}).items()}
        overrides = {k: QualityLimits(**v) for k, v in (data.get("overrides") or {}).items()}
        serving = ServingSLO(**data["serving"]) if data.get("serving") is not None else None
        return build_policy(user_classes, user_types, overrides, SpeedLimits(**(data.get("speed") or {})), serving)
    except (ValidationError, TypeError) as exc:
        raise ConfigError(f"invalid policy {path}: {exc}") from exc


def build_policy(classes: Mapping[str, QualityLimits], types: Mapping[str, QualityLimits] | None = None,
                 overrides: Mapping[str, QualityLimits] | None = None, speed: SpeedLimits | None = None,
                 serving: ServingSLO | None = None) -> Policy:
    """The default policy with a user's limits merged over it: a class's or type's limits set field by field
    over the default's. A class the user sets governs its types: their published defaults are dropped, so a
    ``classes: {Q4: {max_kld: 0.03}}`` policy applies to Q4_K_M too (unless ``types`` sets Q4_K_M)."""
    merged_classes = dict(DEFAULT_CLASSES)
    for name, limits in classes.items():
        base = merged_classes.get(name, QualityLimits()).model_dump()
        merged_classes[name] = QualityLimits(**{**base, **limits.model_dump(exclude_none=True)})
    merged_types = {k: v for k, v in DEFAULT_TYPES.items() if _class_of(k) not in classes}
    for name, limits in (types or {}).items():
        start = merged_types.get(name.upper(), merged_classes.get(_class_of(name.upper()), QualityLimits()))
        merged_types[name.upper()] = QualityLimits(**{**start.model_dump(), **limits.model_dump(exclude_none=True)})
    return Policy(classes=merged_classes, types=merged_types, overrides=dict(overrides or {}),
                  speed=speed or SpeedLimits(), serving=serving)
