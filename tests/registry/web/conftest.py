"""Web fixtures: a small registry built through the Registry API with every case a page must show
(three formats, an evaluated variant, a failed evaluation, an unavailable engine, a never evaluated one,
hostile strings), and real uvicorn servers on loopback.

The metric values of the small registry are SYNTHETIC (written by this fixture, not measured); tests
that need measured numbers use ``demo_registry`` (the real flow on the demo checkpoint)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.specs import SourceKind, SourceRef
from registry import open_registry
from registry.store import RegisterRequest
from tests.registry.web.server import serving

HOSTILE = '<script>alert("x")</script>'
SRC = SourceRef(kind=SourceKind.HUB, path="/hub", repo_id="acme/tiny", revision="main", commit="c0ffee" * 6 + "ab12")
TOOL = {"name": "synthetic-fixture", "version": "1"}


def quality(ppl: float, kld: float, top1: float, engine: str) -> dict[str, Any]:
    return {"kind": "quality", "engine": engine, "engine_version": f"{engine} 1.0", "status": "ok",
            "window_set_id": "ab" * 32, "metrics": {"ppl": ppl, "nll_se": 0.01, "delta_ppl_pct": (ppl / 10 - 1) * 100,
                                                    "kld_mean": kld, "kld_method": "full-vocabulary",
                                                    "top1_agreement": top1}}


def speed(pp: float, tg: float, engine: str) -> dict[str, Any]:
    return {"kind": "speed", "engine": engine, "engine_version": f"{engine} 1.0", "status": "ok",
            "metrics": {"prompt_tok_per_s": {"median": pp}, "decode_tok_per_s": tg}}


# variant -> (format, spec, file name -> bytes, results)
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, bytes], list[dict[str, Any]]]] = {
    "Q8_0": ("gguf", {"type": "Q8_0"}, {"tiny-Q8_0.gguf": b"Q8" * 5000},
             [quality(10.01, 1e-4, 0.99, "llama.cpp"), speed(900.0, 80.0, "llama.cpp")]),
    "Q4_K_M": ("gguf", {"type": "Q4_K_M"}, {"tiny-Q4_K_M.gguf": b"Q4" * 3000},
               [quality(10.2, 3e-3, 0.95, "llama.cpp"), speed(1000.0, 120.0, "llama.cpp")]),
    "Q2_K": ("gguf", {"type": "Q2_K"}, {"tiny-Q2_K.gguf": bytes(range(256)) * 10},
             [{"kind": "quality", "engine": "llama.cpp", "status": "failed",
               "error": f"EngineError: runner crashed {HOSTILE}"}]),
    "AWQ-W4-G128-asym": ("awq", {"bits": 4, "group_size": 128, "symmetric": False},
                         {"config.json": b'{"quant_method": "compressed-tensors"}',
                          "model.safetensors": b"\x00" * 7000, "nested/dir/part.bin": b"nested"},
                         [quality(10.3, 2.5e-3, 0.96, "vllm")]),
    "EXL2-4.0bpw": ("exl2", {"bpw": 4.0, "head_bits": 6}, {"output.safetensors": b"\x01" * 6000},
                    [quality(10.25, 2.8e-3, 0.955, "exl2-reference"),
                     {"kind": "speed", "engine": "exllamav2", "status": "failed",
                      "error": "ToolchainMissingError: ExLlamaV2 needs a CUDA GPU"}]),
    "F16": ("gguf", {"type": "F16"}, {"tiny-F16.gguf": b"F16" * 9000}, []),
}


def build_small_registry(root: Path, tmp: Path) -> None:
    reg = open_registry(str(root))
    for name, (fmt, spec, files, results) in VARIANTS.items():
        paths = {}
        for fname, data in files.items():
            p = tmp / name / fname
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            paths[fname] = p
        lineage = {"tool": TOOL, "parameters": {"note": HOSTILE}, "info": {"bpw": 4.5 if fmt == "gguf" else None}}
        view = reg.register_version(RegisterRequest(
            model="acme/tiny", architecture="LlamaForCausalLM", source=SRC, variant=name, format=fmt, spec=spec,
            build_key=f"synthetic-{name}", lineage=lineage, files=paths))
        for record in results:
            reg.add_result(view.ref, record)
    # A second version of Q8_0 (history across versions) and a named alias on the first.
    extra = tmp / "v2" / "tiny-Q8_0.gguf"
    extra.parent.mkdir()
    extra.write_bytes(b"Q8v2" * 2600)
    v2 = reg.register_version(RegisterRequest(
        model="acme/tiny", architecture="LlamaForCausalLM", source=SRC, variant="Q8_0", format="gguf",
        spec={"type": "Q8_0"}, build_key="synthetic-Q8_0-v2", lineage={"tool": TOOL}, files={"tiny-Q8_0.gguf": extra}))
    reg.add_result(v2.ref, quality(10.0, 9e-5, 0.991, "llama.cpp"))
    reg.set_alias("acme/tiny/Q8_0@1", "production", by="fixture")
    # A second model of another architecture, for the index filters.
    other = tmp / "other.gguf"
    other.write_bytes(b"mamba" * 100)
    reg.register_version(RegisterRequest(
        model="other", architecture="MambaForCausalLM", source=SRC, variant="Q4_0", format="gguf",
        spec={"type": "Q4_0"}, build_key="synthetic-other", lineage={"tool": TOOL}, files={"other.gguf": other}))


@pytest.fixture(scope="session")
def small_registry_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("web-small")
    build_small_registry(base / "registry", base / "files")
    return base / "registry"


@pytest.fixture
def small_registry(tmp_path: Path, small_registry_template: Path) -> Path:
    dest = tmp_path / "small-registry"
    shutil.copytree(small_registry_template, dest)
    return dest


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory, small_registry_template: Path) -> Iterator[str]:
    """A read-only server over a private copy of the small registry, shared by a module's tests."""
    dest = tmp_path_factory.mktemp("web-ro") / "registry"
    shutil.copytree(small_registry_template, dest)
    with serving(str(dest)) as url:
        yield url
