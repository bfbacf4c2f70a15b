"""Size-based splitting: llama-gguf-split parts kept as one registry version, loaded and evaluated by
llama.cpp from part 1, and all restored by ``pull``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from converters.gguf.split import PART_RE, inspect_parts
from flows.quantize import convert_flow
from flows.validate import ValidateOptions, validate
from pipeline.cli import app
from pipeline.errors import InvalidSpecError
from pipeline.plan import EvalSpec, GGUFOptions, Plan, SourceInput, SpeedSpec, parse_split_size, variants_from_flags
from pipeline.policy import Policy
from registry import open_registry
from tests.conftest import DEMO_WINDOWS, make_settings


def test_split_size_is_validated() -> None:
    assert parse_split_size("2g") == "2G" and parse_split_size(" 500M ") == "500M" and parse_split_size(None) is None
    for bad in ("2GB", "1.5G", "0M", "100K", "-1G", "big"):
        with pytest.raises(InvalidSpecError, match="split size"):
            parse_split_size(bad)


def test_split_variant_registered_evaluated_and_pulled(demo_model: Path, demo_registry: Path,
                                                       demo_registry_template: dict[str, object], cache_dir: Path,
                                                       tmp_path: Path, prefect_harness: None) -> None:
    cfg = make_settings(demo_registry, demo_registry_template["work"], cache_dir)  # type: ignore[arg-type]
    plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo", variants=variants_from_flags(
        gguf="Q4_K_M"), eval=EvalSpec(max_windows=DEMO_WINDOWS, speed=SpeedSpec(enabled=False)),
        gguf=GGUFOptions(split_max_size="1M"))
    report = convert_flow(plan, cfg)
    assert report.ok and report.count("split") == 1, report
    reg = open_registry(cfg.registry)
    whole, split = reg.get_version("demo/Q4_K_M@1"), reg.get_version("demo/Q4_K_M@2")  # @1: the unsplit template
    assert report.variants[0].ref == split.ref and len(whole.files) == 1

    names = [f.name for f in split.files]
    assert len(names) >= 2 and all(PART_RE.match(n) for n in names)
    assert [int(PART_RE.match(n)["no"]) for n in names] == list(range(1, len(names) + 1))  # type: ignore[index]
    assert split.lineage["parameters"]["split"] == {"max_size": "1M", "parts": len(names)}
    assert all(f.size <= 1 << 20 for f in split.files[1:])
    assert split.lineage["info"]["tensor_count"] == whole.lineage["info"]["tensor_count"]

    # llama.cpp was given part 1 and found the other parts next to it: the same tensors give the same scores
    q_whole = next(r for r in whole.results if r.kind == "quality").metrics
    q_split = next(r for r in split.results if r.kind == "quality").metrics
    assert q_split["kld_mean"] == pytest.approx(q_whole["kld_mean"], rel=1e-6)
    assert q_split["ppl"] == pytest.approx(q_whole["ppl"], rel=1e-6)

    # validate --reproduce rebuilds it from its lineage with the recorded split size (a default plan would make
    # one file and fail the check falsely)
    assert split.lineage["options"]["split_max_size"] == "1M"
    report = validate(split.ref, cfg, ValidateOptions(policy=Policy(), reproduce=True))
    check = next(c for c in report.checks if c.name == "reproducibility")
    assert check.status == "pass", check.message

    dest = tmp_path / "pulled"
    result = CliRunner().invoke(app, ["pull", split.ref, str(dest), "--registry", str(cfg.registry)])
    assert result.exit_code == 0, result.output
    pulled = sorted(dest.iterdir())
    assert [p.name for p in pulled] == names
    for f, p in zip(split.files, pulled, strict=True):
        assert hashlib.sha256(p.read_bytes()).hexdigest() == f.sha256
    info = inspect_parts(pulled)
    assert (info["parts"], info["tensor_count"]) == (len(names), whole.lineage["info"]["tensor_count"])
    assert GGUFReader(str(pulled[0])).get_field("split.count").contents() == len(names)
