"""GGUF options that change bytes: the base type (chosen from the source dtype unless forced), the split
size and the imatrix calibration all enter the build key; the defaults leave existing keys unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.checkpoint import load_checkpoint
from converters.gguf.converter import choose_base_type
from converters.source import resolve_source
from flows import steps
from pipeline.config import Settings
from pipeline.errors import ConfigError, InvalidSpecError
from pipeline.plan import CalibrationSpec, Plan, SourceInput, parse_gguf_base, variants_from_flags
from pipeline.specs import GGUFSpec
from tests.factories import random_checkpoint


def with_gguf(plan: Plan, **options: object) -> Plan:
    """``plan`` with some GGUF options changed (validated, as a plan from the CLI would be)."""
    return Plan.model_validate({**plan.model_dump(), "gguf": {**plan.gguf.model_dump(), **options}})


@pytest.mark.parametrize(("dtype", "base"), [("bfloat16", "BF16"), ("float16", "F16"), ("float32", "F16")])
def test_base_type_follows_the_source_dtype(dtype: str, base: str, tmp_path: Path, demo_model: Path) -> None:
    ckpt = load_checkpoint(random_checkpoint(tmp_path / dtype, demo_model, layers=1, dtype=dtype))
    assert choose_base_type(ckpt) == base
    assert choose_base_type(ckpt, "f16") == "F16" and choose_base_type(ckpt, "BF16") == "BF16"


def test_base_type_flag_is_validated() -> None:
    assert parse_gguf_base("bf16") == "BF16" and parse_gguf_base("Auto") == "auto"
    assert Plan(source=SourceInput(source="x"), variants=variants_from_flags(gguf="Q8_0"),
                gguf_base_type="f16").gguf.base_type == "F16"  # the flat key of earlier releases still parses
    with pytest.raises(InvalidSpecError, match="f16, bf16 or f32"):
        parse_gguf_base("q8_0")


def test_build_key_covers_base_split_and_calibration(demo_model: Path, settings: Settings, tmp_path: Path) -> None:
    plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo", variants=variants_from_flags(
        gguf="Q4_K_M"))
    resolved = steps.Resolved(source=resolve_source(str(demo_model), cache_dir=settings.cache_dir),
                              model_name="demo", checkpoint=load_checkpoint(demo_model))
    tool = {"name": "llama.cpp"}

    def key(p: Plan, spec: GGUFSpec) -> str:
        return steps.build_key(resolved.source, spec, tool, steps.build_inputs(p, resolved, spec, settings))

    plain, i1 = GGUFSpec(type="Q4_K_M"), GGUFSpec(type="Q4_K_M", imatrix=True)
    assert key(plan, plain) == steps.build_key(resolved.source, plain, tool)  # defaults: keys as before
    other_calib = tmp_path / "calib.txt"
    other_calib.write_text("another calibration text\n" * 200)
    keys = {
        key(plan, plain),
        key(with_gguf(plan, base_type="BF16"), plain),
        key(with_gguf(plan, split_max_size="2G"), plain),
        key(plan, i1),
        key(with_gguf(plan, calibration=CalibrationSpec(chunks=8)), i1),
        key(with_gguf(plan, calibration=CalibrationSpec(file=str(other_calib))), i1),
    }
    assert len(keys) == 6
    missing = with_gguf(plan, calibration=CalibrationSpec(file=str(tmp_path / "nope.txt")))
    with pytest.raises(ConfigError, match="does not exist"):
        key(missing, i1)
