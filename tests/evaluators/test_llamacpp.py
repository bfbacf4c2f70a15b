"""The llama.cpp engine on the shared method (real llama-cpp-python, real transformers reference)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from converters.gguf.header import read_header
from evaluators.base import RunnerCommand, load_arrays, run_runner
from evaluators.llamacpp.evaluator import LlamaCppEvaluator
from evaluators.metrics import compare
from evaluators.speed import DEFINITIONS
from evaluators.windows import WindowSet
from pipeline.config import Settings
from pipeline.errors import EngineError
from pipeline.plan import EvalSpec, SpeedSpec
from pipeline.specs import Engine
from registry import open_registry
from tests.conftest import pids_with
from tests.factories import gguf_set_fields


def _quality(registry: Path, variant: str) -> dict:
    view = open_registry(str(registry)).get_version(f"demo/{variant}")
    return next(r.metrics for r in view.results if r.kind == "quality" and r.status == "ok")


def test_f16_matches_transformers_reference(demo_registry_template: dict) -> None:
    q = _quality(demo_registry_template["registry"], "F16")
    assert abs(q["ppl"] / q["ref_ppl"] - 1) < 0.001, q


def test_kld_ordering_and_top1(demo_registry_template: dict) -> None:
    reg = demo_registry_template["registry"]
    kld = {t: _quality(reg, t)["kld_mean"] for t in ("Q8_0", "Q4_K_M", "Q2_K")}
    assert kld["Q8_0"] < kld["Q4_K_M"] < kld["Q2_K"], kld
    assert _quality(reg, "Q8_0")["top1_agreement"] >= 0.98


def test_speed_is_recorded_with_hardware(demo_registry_template: dict) -> None:
    view = open_registry(str(demo_registry_template["registry"])).get_version("demo/Q4_K_M")
    speed = next(r for r in view.results if r.kind == "speed")
    m = speed.metrics
    for key in ("prompt_tok_per_s", "decode_tok_per_s", "ttft_ms"):
        assert m[key]["median"] > 0 and m[key]["min"] <= m[key]["median"] <= m[key]["max"]
    assert set(m["parallel"]["by_parallel"]) == {"1", "4"}, m["parallel"]
    assert m["parallel"]["by_parallel"]["4"]["aggregate_tok_per_s"]["median"] > 0
    assert m["definitions"] == DEFINITIONS and m["shape"] == "cpu-scaled" and m["gen_tokens"] == 32
    kv = m["engine_settings"]["kv_cache"]
    assert kv["type_k"] == kv["type_v"] == "f16" and kv["n_ctx"] >= m["prompt_tokens"] + m["gen_tokens"]
    assert m["engine_settings"]["threads"]["n_threads"] == 2 and m["engine_settings"]["cuda_graphs"] == "n/a (CPU)"
    assert speed.hardware["cores"] and speed.hardware["threads"] == 2 and speed.hardware["cpu"]
    assert "llama-cpp-python 0.3.36" in speed.engine_version
    # The kernels the build has, as llama.cpp reports them: no AMX where the CPU has AMX but the build left it out.
    built = speed.hardware["llama_cpp_build"].split()
    assert "AVX2" in built or "NEON" in built, built
    assert ("AMX_INT8" in built) == ("amx_int8" in Path("/proc/cpuinfo").read_text().split()
                                     and os.environ.get("QUANTYARD_LLAMA_AMX", "auto") == "on"), built


def _reference_and_windows(demo_registry_template: dict) -> tuple[Path, Path]:
    report = demo_registry_template["report"]
    reg = open_registry(str(demo_registry_template["registry"]))
    ref = reg.list_source_artifacts(report.source["identity"], "reference")[0]
    ws = reg.list_source_artifacts(report.source["identity"], "window_set")[0]
    return reg.artifact_path(ref), reg.artifact_path(ws)


def test_variant_against_itself_is_exactly_zero(tmp_path: Path, demo_registry_template: dict,
                                                cache_dir: Path) -> None:
    """Run the engine twice on one GGUF; use run 1 as the 'reference' of run 2: KLD is exactly 0."""
    _, windows = _reference_and_windows(demo_registry_template)
    reg = open_registry(str(demo_registry_template["registry"]))
    files = reg.link_files("demo/Q4_K_M", tmp_path / "m")
    gguf = files[0]
    ws = WindowSet.load(windows)
    small = tmp_path / "w.npz"
    WindowSet(ids=ws.ids[:4], score_start=ws.score_start[:4], window=ws.window, stride=ws.stride,
              add_bos=ws.add_bos, text_sha256=ws.text_sha256).save(small)
    cfg = Settings(cache_dir=cache_dir, threads=2)
    cmd = RunnerCommand(engine=Engine.LLAMA_CPP, python=cfg.core_python, module="evaluators.llamacpp.runner")
    base = {"model": str(gguf), "windows": str(small), "top_k": 32, "threads": 2}
    first = run_runner(cmd, {**base, "store_full": True}, tmp_path / "a", 600)
    assert first.arrays is not None
    second = run_runner(cmd, {**base, "reference": str(first.arrays), "kld": "full"}, tmp_path / "b", 600)
    bound = run_runner(cmd, {**base, "reference": str(first.arrays), "kld": "topk"}, tmp_path / "c", 600)
    ref = load_arrays(first.arrays)
    m = compare(ref, load_arrays(second.arrays))
    # exact KLD against its own stored distribution: only the 16-bit grid's rounding, KL(P̃‖P) ≈ step²/24
    assert 0.0 <= m["kld_max"] <= float(np.max(ref["full_step"])) ** 2 and m["top1_agreement"] == 1.0
    lb = compare(ref, load_arrays(bound.arrays))  # the top-K bound: exactly 0
    assert lb["kld_topk_lower_bound_mean"] == 0.0 and lb["kld_topk_lower_bound_max"] == 0.0
    assert np.array_equal(ref["target_logprob"], load_arrays(second.arrays)["target_logprob"])


def _runner_pids(tmp_path: Path) -> list[int]:
    """This test's llama.cpp runners (their request file is under its tmp_path), not another worker's."""
    return pids_with(b"evaluators.llamacpp.runner", (str(tmp_path).encode(),))


def test_sigkill_of_runner_gives_engine_error(tmp_path: Path, demo_registry_template: dict,
                                              cache_dir: Path) -> None:
    reference, windows = _reference_and_windows(demo_registry_template)
    files = open_registry(str(demo_registry_template["registry"])).link_files("demo/Q8_0", tmp_path / "m")
    cfg = Settings(cache_dir=cache_dir, threads=2)
    stop = threading.Event()

    def killer() -> None:
        while not stop.is_set():
            for pid in _runner_pids(tmp_path):
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        with pytest.raises(EngineError) as info:
            LlamaCppEvaluator().evaluate(files[0], windows=windows, window_set_id="x", reference=reference,
                                         spec=EvalSpec(speed=SpeedSpec(enabled=False)), out_dir=tmp_path / "ev",
                                         settings=cfg)
    finally:
        stop.set()
        thread.join()
    assert info.value.returncode == -signal.SIGKILL and "SIGKILL" in str(info.value)


def test_a_file_llama_cpp_refuses_fails_with_llama_cpps_reason(tmp_path: Path, demo_registry_template: dict,
                                                                cache_dir: Path) -> None:
    """llama-cpp-python says only "Failed to load model from file"; the evaluation error carries what
    llama.cpp's loader logged: here a GGUF whose K/V head count (metadata) does not fit its K weight."""
    reference, windows = _reference_and_windows(demo_registry_template)
    gguf = open_registry(str(demo_registry_template["registry"])).link_files("demo/Q8_0", tmp_path / "m")[0]
    kv_heads = int(read_header(gguf).get("llama.attention.head_count_kv"))
    crafted = tmp_path / "doubled-kv.gguf"
    gguf_set_fields(gguf, crafted, **{"llama.attention.head_count_kv": 2 * kv_heads})
    with pytest.raises(EngineError) as info:
        LlamaCppEvaluator().evaluate(crafted, windows=windows, window_set_id="x", reference=reference,
                                     spec=EvalSpec(speed=SpeedSpec(enabled=False)), out_dir=tmp_path / "ev",
                                     settings=Settings(cache_dir=cache_dir, threads=2))
    said = info.value.summary()
    assert "llama.cpp cannot load doubled-kv.gguf: check_tensor_dims: tensor 'blk.0.attn_k.weight' has wrong shape" \
        in said, said
    assert "Failed to load model from file" not in said, said


def _run(tmp_path: Path, cache_dir: Path, gguf: Path, windows: Path, tag: str) -> dict[str, np.ndarray]:
    cfg = Settings(cache_dir=cache_dir, threads=2)
    cmd = RunnerCommand(engine=Engine.LLAMA_CPP, python=cfg.core_python, module="evaluators.llamacpp.runner")
    out = run_runner(cmd, {"model": str(gguf), "windows": str(windows), "ref_topk": None, "top_k": 32,
                           "threads": 2}, tmp_path / tag, 600)
    assert out.arrays is not None
    return load_arrays(out.arrays)


def test_scored_rows_only_equal_full_scoring(tmp_path: Path, demo_registry_template: dict, cache_dir: Path) -> None:
    """The runner asks llama.cpp for the logits of scored rows only: a window set scored from the middle
    gives, position for position, what the all-positions set gives for the same targets."""
    _, windows = _reference_and_windows(demo_registry_template)
    gguf = open_registry(str(demo_registry_template["registry"])).link_files("demo/Q4_K_M", tmp_path / "m")[0]
    ws = WindowSet.load(windows)
    n, w, half = 3, ws.window, ws.window // 2 + 1
    sets = {}
    for name, first in (("all", 1), ("half", half)):
        sets[name] = tmp_path / f"{name}.npz"
        WindowSet(ids=ws.ids[:n], score_start=np.full(n, first, dtype=np.int32), window=w, stride=ws.stride,
                  add_bos=ws.add_bos, text_sha256=ws.text_sha256).save(sets[name])
    full = _run(tmp_path, cache_dir, gguf, sets["all"], "all")
    late = _run(tmp_path, cache_dir, gguf, sets["half"], "half")
    pick = np.concatenate([k * (w - 1) + np.arange(half - 1, w - 1) for k in range(n)])
    assert len(late["target_logprob"]) == n * (w - half) == len(pick)
    for key in ("target_logprob", "topk_logprobs", "tail_logprob"):
        np.testing.assert_allclose(late[key], full[key][pick], rtol=0, atol=1e-5, err_msg=key)
    assert np.array_equal(late["top1"], full["top1"][pick])
    assert (late["topk_ids"][:, 0] == full["topk_ids"][pick][:, 0]).all()


def _llama_perplexity(cache_dir: Path, model: Path, text: Path, ctx: int, chunks: int) -> float:
    """The final PPL printed by llama-perplexity of the same build. llama.cpp's asynchronous logger can drop
    the last lines when the process exits at once (see TOOLCHAINS.md): a run without them is run again."""
    import re
    import subprocess

    from pipeline.llama_cpp import llama_cpp_toolchain

    tools = llama_cpp_toolchain(Settings(cache_dir=cache_dir))
    cmd = [str(tools.exe("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(ctx),
           "-b", str(ctx), "--chunks", str(chunks), "-t", "2", "-tb", "2"]
    for _ in range(3):
        res = subprocess.run(cmd, capture_output=True, text=True, env=tools.env(), check=True, timeout=600)
        found = re.search(r"Final estimate: PPL = ([0-9.]+)", res.stdout + res.stderr)
        if found:
            return float(found.group(1))
    raise AssertionError("llama-perplexity printed no final estimate in 3 runs:\n" + (res.stdout + res.stderr)[-2000:])


def test_perplexity_agrees_with_llama_perplexity(tmp_path: Path, demo_registry_template: dict, demo_model: Path,
                                                 cache_dir: Path) -> None:
    """Scored like llama-perplexity (second half of each chunk, chunks cut from BOS + text), on the same GGUF:
    the two tools compute the same perplexity (llama-perplexity prints 4 decimals)."""
    from evaluators.metrics import perplexity
    from evaluators.windows import build_window_set

    gguf = open_registry(str(demo_registry_template["registry"])).link_files("demo/Q8_0", tmp_path / "m")[0]
    ctx, chunks = 128, 8
    text = demo_model / "eval.txt"
    ws = build_window_set(demo_model, text.read_text(), window=ctx, stride=ctx, max_windows=chunks,
                          score_from=ctx // 2 + 1)
    ws.save(tmp_path / "w.npz")
    ours = perplexity(_run(tmp_path, cache_dir, gguf, tmp_path / "w.npz", "ours")["target_logprob"]).ppl
    theirs = _llama_perplexity(cache_dir, gguf, text, ctx, chunks)
    assert abs(ours - theirs) <= 1e-4 + 1e-6 * theirs, (ours, theirs)
