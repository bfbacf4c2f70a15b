"""Adding a format takes what converters/README.md says and nothing else: one package and one line in
``FORMATS``. A throw-away format (``toy``: every floating-point weight rounded to bfloat16, saved as a
safetensors folder) is written to a temporary package, registered with one line, then converted,
evaluated on an existing engine (transformers), registered, listed on the web page and validated, end to
end through the real flow."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pipeline.formats import FORMATS, FormatInfo
from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec
from pipeline.specs import Engine
from registry import open_registry
from tests.conftest import make_settings

TOY_PACKAGE = '''
"""A throw-away format: the checkpoint with every floating-point weight rounded to bfloat16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, ClassVar, Literal

from converters.base import BuildContext, BuiltVariant, Footprint, Prepared
from converters.checkpoint import Checkpoint
from pipeline.config import Settings
from pipeline.footprint import TORCH_PROCESS, Need
from pipeline.specs import Frozen, SourceRef


class ToySpec(Frozen):
    format: Literal["toy"] = "toy"
    dtype: Literal["bfloat16"] = "bfloat16"

    @property
    def name(self) -> str:
        return "TOY-BF16"

    @property
    def quant_class(self) -> str:
        return "F16"


class ToyConverter:
    format: ClassVar[str] = "toy"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def tool_identity(self) -> dict[str, Any]:
        import torch

        return {"name": "toy", "torch": torch.__version__}

    def check(self, checkpoint: Checkpoint, specs: list[Any]) -> None:
        return None

    def footprint(self, checkpoint: Checkpoint, source: SourceRef, specs: list[Any]) -> Footprint:
        """ESTIMATES: build loads every shard and writes it in bfloat16 (2 bytes per parameter)."""
        weights = checkpoint.facts.n_params * 2
        need = Need.of("toy: the weights in bfloat16", ("weights", weights), ("interpreter", TORCH_PROCESS))
        return Footprint(needs=(need.at("build:*"),), variant_bytes={s.name: weights for s in specs})

    def prepare(self, ctx: BuildContext, specs: list[Any]) -> Prepared:
        return Prepared()

    def build(self, ctx: BuildContext, prepared: Prepared, spec: ToySpec, out_dir: Path) -> BuiltVariant:
        import torch
        from safetensors.torch import load_file, save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for shard in sorted(ctx.checkpoint.path.glob("*.safetensors")):
            for name, t in load_file(shard).items():
                tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
        save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
        for f in ctx.checkpoint.path.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".json")) or f.name in (
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
                shutil.copyfile(f, out_dir / f.name)
        config = json.loads((ctx.checkpoint.path / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
        files = {p.name: p for p in sorted(out_dir.iterdir()) if p.is_file()}
        return BuiltVariant(variant=spec.name, files=files, tool=self.tool_identity(),
                            parameters={"dtype": spec.dtype}, events=["toy"], info={"tensors": len(tensors)})
'''


@pytest.fixture
def toy_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FormatInfo:
    """The throw-away package on sys.path, and its one line in FORMATS."""
    root = tmp_path / "pkgs"
    (root / "toyfmt").mkdir(parents=True)
    (root / "toyfmt" / "__init__.py").write_text(textwrap.dedent(TOY_PACKAGE))
    monkeypatch.syspath_prepend(str(root))
    from toyfmt import ToySpec  # type: ignore[import-not-found]

    info = FormatInfo(format="toy", label="TOY", spec=ToySpec, converter="toyfmt:ToyConverter",  # type: ignore[arg-type]
                      engine=Engine.TRANSFORMERS, pool="cpu")
    monkeypatch.setitem(FORMATS, "toy", info)  # type: ignore[index]  # the one registry line
    return info


def test_a_throw_away_format_converts_evaluates_registers_and_lists(
        toy_format: FormatInfo, demo_model: Path, cache_dir: Path, tmp_path: Path, prefect_harness: None) -> None:
    from flows.quantize import convert_flow
    from flows.validate import ValidateOptions, validate
    from pipeline.policy import Policy
    from registry.web.app import create_app

    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    plan = Plan.model_validate({"source": SourceInput(source=str(demo_model)).model_dump(), "model_name": "demo",
                                "variants": [{"format": "toy"}],
                                "eval": EvalSpec(max_windows=2, speed=SpeedSpec(enabled=False)).model_dump()})
    report = convert_flow(plan, cfg)
    assert report.ok, report
    (out,) = report.variants
    assert (out.variant, out.format, out.status) == ("TOY-BF16", "toy", "registered")
    assert out.engine == "transformers" and out.quality is not None
    # bfloat16 rounding of a float32 model: close to the reference, not identical
    assert 0 < out.quality["kld_mean"] < 0.05 and out.quality["top1_agreement"] > 0.9

    view = open_registry(cfg.registry).get_version("demo/TOY-BF16")
    assert view.format == "toy" and view.lineage["tool"]["name"] == "toy" and view.lineage["options"] == {}
    assert any(r.kind == "quality" and r.engine == "transformers" for r in view.results)

    again = convert_flow(plan, cfg)  # the build key holds: nothing is rebuilt
    assert again.variants[0].status == "reused"

    page = TestClient(create_app(open_registry(cfg.registry))).get("/models/demo")
    assert page.status_code == 200 and "TOY-BF16" in page.text

    checks = {c.name: c for c in validate("demo/TOY-BF16", cfg, ValidateOptions(policy=Policy())).checks}
    assert checks["integrity"].status == "pass"
    assert checks["format"].status == "skip"  # the toy package has no sanity hook: said, not faked
    assert checks["quality"].details["class"] == "F16" and checks["quality"].details["reused_result"] is True
