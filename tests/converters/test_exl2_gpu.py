"""EXL2 against real ExLlamaV2 on CUDA (marked ``gpu``; skipped with the reason elsewhere).

Run by ``scripts/gpu-check-exl2.sh`` on a lent GPU machine. With ``QUANTYARD_GOLDEN_OUT`` set, the
parity test also writes the small golden fixtures that ``test_exl2_golden.py`` checks on CPU.
This module imports only what the GPU machine has plus Quantyard's light dependencies (no Prefect).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from converters.base import BuildContext, Calibration
from converters.checkpoint import load_checkpoint
from converters.exl2.converter import EXL2Converter
from converters.source import resolve_source
from pipeline.config import Settings
from pipeline.exl2_codec import decode, dequantize_layer, layer_prefixes, split_layer
from pipeline.specs import EXL2Backend, EXL2Spec
from tests.exl2_support import exl2_runtime, gpu_demo  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu


def _ctx(demo: Path, cfg: Settings) -> BuildContext:
    return BuildContext(checkpoint=load_checkpoint(demo), source=resolve_source(str(demo), cache_dir=cfg.cache_dir),
                        model_name="demo", settings=cfg,
                        calibration=Calibration((demo / "calibration.txt").read_text(encoding="utf-8"),
                                                "checkpoint:calibration.txt"))


def _build(cfg: Settings, demo: Path, spec: EXL2Spec, out: Path) -> tuple[Any, Any]:
    conv = EXL2Converter(cfg)
    ctx = _ctx(demo, cfg)
    prepared = conv.prepare(ctx, [spec])
    return prepared, conv.build(ctx, prepared, spec, out)


def test_exllamav2_measures_once_and_builds_each_bpw(exl2_runtime: Settings, gpu_demo: Path,  # noqa: F811
                                                     tmp_path: Path) -> None:
    cfg = exl2_runtime
    conv = EXL2Converter(cfg)
    spec4 = conv.resolve_spec(EXL2Spec(bpw=4.0))
    assert spec4.backend == EXL2Backend.EXLLAMAV2 and spec4.name == "EXL2-4.0bpw"
    ctx = _ctx(gpu_demo, cfg)
    first = conv.prepare(ctx, [spec4])
    assert first.events == ["measure"] and Path(first.source_artifacts[0]["path"]).is_file()
    again = conv.prepare(ctx, [spec4])
    assert again.events == []  # the measurement is done once per source and calibration
    for bpw in (3.0, 4.0, 6.0):
        spec = conv.resolve_spec(EXL2Spec(bpw=bpw))
        built = conv.build(ctx, first, spec, tmp_path / spec.name)
        info = built.info
        assert info["backend"] == "exllamav2" and info["quantized_layers"] == 29
        assert abs(info["decoder_bpw"] / info["decoder_bpw_on_disk"] - 1) < 0.01
        assert abs(info["decoder_bpw"] - bpw) < 0.5, info
        calib = built.parameters["calibration"]
        assert calib["rows"] >= 1 and calib["length"] >= 16 and calib["sha256"]


def _exllamav2_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """Every linear layer's weight as ExLlamaV2 itself reconstructs it (fp16, [in, out_padded])."""
    from exllamav2 import ExLlamaV2, ExLlamaV2Config
    from exllamav2.linear import ExLlamaV2Linear

    config = ExLlamaV2Config(str(folder))
    model = ExLlamaV2(config)
    model.load()
    out = {}
    for module in model.modules:
        for sub in [module, *getattr(module, "submodules", [])]:
            if isinstance(sub, ExLlamaV2Linear) and sub.q_handle is not None:
                out[sub.key] = sub.get_weight_tensor_dq().cpu().clone()
    model.unload()
    return out


def _undo_mlp_remap(theirs: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Put ExLlamaV2's reconstruction of each MLP back in the weights' own order, in place.

    ExLlamaV2 loads an MLP's ``down_proj`` without its permutation (exllamav2/mlp.py: ``load(unmap=True)``) and
    reorders ``gate_proj``'s and ``up_proj``'s output columns by it instead (linear.py: ``tensor_remap`` with
    ``output_map``): the MLP computes the same, but ``get_weight_tensor_dq()`` returns down's rows and gate's and
    up's columns in quantized order. Row (column) ``j`` of the weight is row (column) ``q_invperm[j]`` there.
    Without this every MLP layer compared unequal on the H200 (2026-12-04), whichever tool wrote the file."""
    for key in [k for k in theirs if k.endswith(".down_proj")]:
        inverse = tensors.get(f"{key}.q_invperm")
        if inverse is None:
            continue
        inv = inverse.long().cpu()
        theirs[key] = theirs[key][inv]
        mlp = key.removesuffix(".down_proj")
        for sibling in (f"{mlp}.gate_proj", f"{mlp}.up_proj"):
            if sibling in theirs:
                theirs[sibling] = theirs[sibling][:, inv]


def _compare(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    theirs = _exllamav2_dequantized(folder)
    _undo_mlp_remap(theirs, tensors)
    prefixes = layer_prefixes(list(tensors))
    assert set(theirs) == set(prefixes) and prefixes
    report = {}
    for p in prefixes:
        layer = decode(split_layer(tensors, p), out_features=tensors[f"{p}.q_weight"].shape[1])
        ours = dequantize_layer(layer).t().contiguous()  # [in, out_padded], as ExLlamaV2 returns it
        ref = theirs[p]
        same = torch.equal(ours.view(torch.int16), ref.view(torch.int16))
        report[p] = {"identical": same, "widths": sorted({g.bits for g in layer.groups}, reverse=True),
                     "max_abs_diff": float((ours.float() - ref.float()).abs().max())}
    return {"layers": report, "tensors": tensors, "theirs": theirs}


def test_codec_dequantizes_bit_for_bit_like_exllamav2(exl2_runtime: Settings, gpu_demo: Path,  # noqa: F811
                                                      tmp_path: Path) -> None:
    """Both directions of the format: files exllamav2 wrote, and files the reference codec wrote."""
    cfg = exl2_runtime
    _, real = _build(cfg, gpu_demo, EXL2Spec(bpw=4.0, backend=EXL2Backend.EXLLAMAV2), tmp_path / "real")
    _, ours = _build(cfg, gpu_demo, EXL2Spec(bpw=3.0, backend=EXL2Backend.REFERENCE_CPU), tmp_path / "ours")
    results = {name: _compare(tmp_path / name) for name in ("real", "ours")}
    summary = {name: r["layers"] for name, r in results.items()}
    out = os.environ.get("QUANTYARD_GOLDEN_OUT")
    if out:
        _write_golden(Path(out), results, real, ours)
        (Path(out) / "parity.json").write_text(json.dumps(summary, indent=1))
    bad = {n: {k: v for k, v in layers.items() if not v["identical"]} for n, layers in summary.items()}
    assert not any(bad.values()), bad


def _write_golden(dest: Path, results: dict[str, Any], real: Any, ours: Any) -> None:
    """A few layers covering several widths (< 2 MB): their tensors plus ExLlamaV2's reconstruction."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    chosen: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"layers": {}}
    seen_widths: set[tuple[int, ...]] = set()
    for origin in ("real", "ours"):
        r = results[origin]
        for p, info in r["layers"].items():
            key = tuple(info["widths"])
            if key in seen_widths or p.endswith("lm_head"):  # the head alone would be over 2 MB
                continue
            if sum(t.numel() * t.element_size() for t in chosen.values()) > 1_200_000:
                break
            seen_widths.add(key)
            name = f"{origin}.{p}"
            for suffix, t in split_layer(r["tensors"], p).items():
                chosen[f"{name}.{suffix}"] = t.contiguous()
            chosen[f"{name}.exllamav2_dq"] = r["theirs"][p].contiguous()
            meta["layers"][name] = {"out_features": int(r["theirs"][p].shape[1]), "widths": info["widths"],
                                    "written_by": "exllamav2" if origin == "real" else "quantyard reference-cpu"}
    import exllamav2

    meta.update({"exllamav2_dq": "ExLlamaV2Linear.get_weight_tensor_dq(), its MLP reordering undone "
                                 "(tests/converters/test_exl2_gpu.py _undo_mlp_remap)",
                 "exllamav2": exllamav2.__version__, "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0), "real_tool": real.tool, "ours_tool": ours.tool})
    save_file(chosen, str(dest / "golden.safetensors"))
    (dest / "golden.json").write_text(json.dumps(meta, indent=1, default=str))
