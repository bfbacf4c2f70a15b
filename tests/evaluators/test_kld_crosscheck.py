"""Quantyard's exact KL-divergence is llama.cpp's: the mean KLD of each GGUF type, on the same files and the same
scored positions, agrees with ``llama-perplexity --kl-divergence`` (same llama.cpp build) within 1 % relative (2 %
below a KLD of 1e-4, the demo's Q8_0) of some number the printed one may stand for (it is rounded to 6 decimals:
a demo Q8_0 KLD of 1.75e-5 prints as 0.000018); see ``evaluators.llamacpp.crosscheck.agreement_tolerance``.

Both sides score the second half of 512-token chunks of the checkpoint's eval.txt (Quantyard: ``--window 512
--stride 512 --score-from 257``). llama.cpp's base is the F16 GGUF, stored on its 16-bit grid over 16 nats and
without the tokens below log-prob −16; Quantyard's reference is the unquantized checkpoint in transformers
(fp32 on the demo; the real checkpoint's bf16 weights in fp32), stored on a 16-bit grid over 40 nats, every
token kept. The agreement measured (bench/results/kld_exact.txt): 0.01–0.3 %.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evaluators.base import RunnerCommand, load_arrays, run_runner, window_sizes
from evaluators.llamacpp.crosscheck import agreement_tolerance, kl_divergence, save_base
from evaluators.metrics import compare
from evaluators.windows import build_window_set
from pipeline.config import Settings
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.specs import Engine
from registry import open_registry
from tests.conftest import REAL_WINDOWS

TYPES = ("Q8_0", "Q4_K_M", "Q2_K")
DEMO_CHUNKS = 8

pytestmark = pytest.mark.slow


def _pull(registry: object, model: str, variant: str, dest: Path) -> Path:
    files = open_registry(str(registry)).pull(f"{model}/{variant}", dest / "files" / variant)
    return next(p for p in files if p.suffix == ".gguf")


def _llama(settings: Settings, files: dict[str, Path], text: Path, chunks: int, work: Path) -> dict[str, float]:
    tools = llama_cpp_toolchain(settings)
    base = work / "base.kld"
    save_base(tools, files["F16"], text, base, ctx=512, chunks=chunks, threads=settings.threads)
    return {t: kl_divergence(tools, files[t], base, threads=settings.threads).kld_mean for t in TYPES}


def _assert_agree(ours: dict[str, float], theirs: dict[str, float]) -> None:
    for t in TYPES:
        tol = agreement_tolerance(theirs[t], ours=ours[t])
        assert abs(ours[t] - theirs[t]) <= tol, (t, ours[t], theirs[t], tol)
    assert ours["Q8_0"] < ours["Q4_K_M"] < ours["Q2_K"]


@pytest.mark.parametrize(("printed", "ours", "agrees"), [
    (1.8e-5, 1.7467e-5, True),   # 0.2 % from 1.75e-5, which prints as 0.000018: agrees (a rounding boundary)
    (1.8e-5, 1.7316e-5, True),   # 1.05 % from 1.75e-5: within the 2 % asked below a KLD of 1e-4
    (1.8e-5, 1.70e-5, False),    # 2.9 % below the lowest number 0.000018 stands for
    (1.8e-5, 1.885e-5, True), (1.8e-5, 1.90e-5, False),  # above: within 2 % of 1.85e-5, or not
    (0.053751, 0.05428, True), (0.053751, 0.0544, False),  # 1 % above 1e-4
    (0.053751, 0.05322, True), (0.053751, 0.05320, False)])
def test_agreement_with_a_printed_number(printed: float, ours: float, agrees: bool) -> None:
    assert (abs(ours - printed) <= agreement_tolerance(printed, ours=ours)) is agrees


def test_demo_kld_agrees_with_llama_perplexity(tmp_path: Path, demo_registry_template: dict, demo_model: Path,
                                               cache_dir: Path) -> None:
    """Demo checkpoint, 8 chunks: the transformers reference with its whole distribution, each GGUF type on
    Quantyard's llama.cpp runner, and llama-perplexity's two-step KLD on the same files."""
    cfg = Settings(cache_dir=cache_dir, threads=2)
    files = {t: _pull(demo_registry_template["registry"], "demo", t, tmp_path) for t in ("F16", *TYPES)}
    text = demo_model / "eval.txt"
    ws = build_window_set(demo_model, text.read_text(), window=512, stride=512, score_from=257,
                          max_windows=DEMO_CHUNKS)
    windows = tmp_path / "windows.npz"
    ws.save(windows)
    ref = run_runner(RunnerCommand(engine=Engine.TRANSFORMERS, python=cfg.core_python,
                                   module="evaluators.transformers.runner"),
                     {"model": str(demo_model), "windows": str(windows), "top_k": 32, "threads": 2,
                      "store_full": True}, tmp_path / "ref", 600)
    assert ref.arrays is not None
    cmd = RunnerCommand(engine=Engine.LLAMA_CPP, python=cfg.core_python, module="evaluators.llamacpp.runner",
                        env=llama_cpp_toolchain(cfg).env())
    ours = {}
    for t in TYPES:
        out = run_runner(cmd, {"model": str(files[t]), "windows": str(windows), "reference": str(ref.arrays),
                               "kld": "full", "top_k": 32, "threads": 2}, tmp_path / t, 600)
        assert out.arrays is not None
        ours[t] = compare(load_arrays(ref.arrays), load_arrays(out.arrays), window_sizes(windows))["kld_mean"]
    _assert_agree(ours, _llama(cfg, files, text, DEMO_CHUNKS, tmp_path))


def test_real_checkpoint_kld_agrees_with_llama_perplexity(tmp_path: Path, real_registry_template: dict,
                                                          real_model: Path) -> None:
    """The real checkpoint's registered results (the flow's own evaluation, exact KLD against the transformers
    reference) against llama-perplexity on the registered files, REAL_WINDOWS chunks."""
    cfg = real_registry_template["settings"]
    reg = open_registry(str(real_registry_template["registry"]))
    ours = {}
    for t in TYPES:
        view = reg.get_version(f"smollm2-135m/{t}")
        (quality,) = [r.metrics for r in view.results if r.kind == "quality" and r.status == "ok"
                      and r.engine == "llama.cpp"]
        assert quality["kld_method"] == "full-vocabulary" and quality["n_tokens"] == REAL_WINDOWS * 255
        ours[t] = quality["kld_mean"]
    files = {t: _pull(real_registry_template["registry"], "smollm2-135m", t, tmp_path) for t in ("F16", *TYPES)}
    _assert_agree(ours, _llama(cfg, files, real_model / "eval.txt", REAL_WINDOWS, tmp_path))
