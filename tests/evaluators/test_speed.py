"""The speed definitions (evaluators/speed.py) on hand-made timestamps, the shape every engine gets, and the
conversion of llama.cpp's reference tools' output."""

from __future__ import annotations

from pathlib import Path

import pytest

from evaluators import speed as sp
from evaluators.base import speed_request
from pipeline.plan import EvalSpec, SpeedSpec

ROOT = Path(__file__).resolve().parents[2]


def test_batch1_definitions() -> None:
    s = sp.Seq(t_submit=10.0, t_first=10.1, t_last=11.1, n_prompt=512, n_generated=101)
    assert sp.ttft_ms(s) == pytest.approx(100.0)
    assert sp.prompt_tok_per_s(s) == pytest.approx(5120.0)
    assert sp.decode_tok_per_s(s) == pytest.approx(100.0)  # 100 tokens after the first, in 1 s


def test_aggregate_is_end_to_end_and_decode_only_is_after_the_last_prefill() -> None:
    seqs = [sp.Seq(0.0, 0.5, 2.0, 64, 31), sp.Seq(0.0, 1.0, 2.5, 64, 31)]
    assert sp.aggregate_tok_per_s(seqs) == pytest.approx(62 / 2.5)
    assert sp.decode_aggregate_tok_per_s(seqs) == pytest.approx(60 / 1.5)


def test_bad_timestamps_raise() -> None:
    with pytest.raises(ValueError, match="t_submit ≤ t_first ≤ t_last"):
        sp.Seq(1.0, 0.5, 2.0, 8, 2)
    with pytest.raises(ValueError, match="at least 2 generated"):
        sp.decode_tok_per_s(sp.Seq(0.0, 0.5, 0.5, 8, 1))
    with pytest.raises(ValueError, match="positive"):
        sp.prompt_tok_per_s(sp.Seq(0.0, 0.0, 1.0, 8, 2))


def test_result_records_definitions_shape_and_settings() -> None:
    shape = sp.resolve_shape({**sp.SEED_SHAPE, "repeats": 2, "parallel": [2]}, "cpu")
    single = [sp.Seq(0.0, 0.1, 0.5, 128, 32), sp.Seq(1.0, 1.2, 1.8, 128, 32)]
    par = {2: [[sp.Seq(0.0, 0.2, 1.0, 64, 32), sp.Seq(0.0, 0.2, 1.0, 64, 32)]] * 2}
    settings = sp.engine_settings(dtype="f32", kernel="k", cuda_graphs="n/a (CPU)", kv_cache={"n_ctx": 1}, threads=2)
    out = sp.speed_result(shape, single, par, settings, tool="t")
    assert out["definitions"] == sp.DEFINITIONS and out["shape"] == "cpu-scaled" and out["repeats"] == 2
    assert (out["prompt_tokens"], out["gen_tokens"]) == (128, 32) and out["parallel_n"] == [2]
    assert out["prompt_tok_per_s"]["median"] == pytest.approx((1280 + 640) / 2)
    tg = (31 / 0.4, 31 / 0.6)
    assert out["decode_tok_per_s"] == {"median": pytest.approx(sum(tg) / 2), "min": pytest.approx(tg[1]),
                                       "max": pytest.approx(tg[0]), "n": 2}
    row = out["parallel"]["by_parallel"]["2"]
    assert row["aggregate_tok_per_s"]["median"] == pytest.approx(64.0) and row["n_sequences"] == 2
    assert out["engine_settings"]["cuda_graphs"] == "n/a (CPU)"
    with pytest.raises(TypeError):
        sp.engine_settings(dtype="f32", kernel="k", kv_cache={}, threads=2)  # type: ignore[call-arg]


def test_shape_is_the_seed_on_gpu_and_scaled_on_cpu_for_every_engine() -> None:
    gpu = speed_request(EvalSpec(), "cuda")
    cpu = speed_request(EvalSpec(), "cpu")
    assert gpu is not None and cpu is not None
    assert {k: gpu[k] for k in sp.SHAPE_KEYS} == sp.SEED_SHAPE and gpu["shape"] == "seed"
    assert {k: cpu[k] for k in sp.SHAPE_KEYS} == sp.CPU_SCALED_SHAPE and cpu["shape"] == "cpu-scaled"
    small = speed_request(EvalSpec(speed=SpeedSpec(prompt_tokens=64, gen_tokens=16)), "cpu")
    assert small is not None and (small["prompt_tokens"], small["gen_tokens"]) == (64, 16)
    custom = speed_request(EvalSpec(speed=SpeedSpec(gen_tokens=128)), "cuda")
    assert custom is not None and custom["shape"] == "custom" and custom["gen_tokens"] == 128
    assert speed_request(EvalSpec(speed=SpeedSpec(enabled=False)), "cpu") is None
    unscaled = speed_request(EvalSpec(speed=SpeedSpec(cpu_scaled=False)), "cpu")
    assert unscaled is not None and unscaled["shape"] == "seed" and unscaled["gen_tokens"] == 256


def test_comparable_names_what_differs() -> None:
    a = {"definitions": sp.DEFINITIONS, **sp.CPU_SCALED_SHAPE, "shape": "cpu-scaled"}
    assert sp.comparable(a, dict(a)) == []
    assert sp.comparable(a, {**a, "gen_tokens": 128, "definitions": None}) == [
        f"definitions: {sp.DEFINITIONS!r} vs None", "gen_tokens: 32 vs 128"]


def test_llama_bench_rows_convert() -> None:
    rows = [{"n_prompt": 128, "n_gen": 0, "n_depth": 0, "samples_ns": [10_000_000, 20_000_000]},
            {"n_prompt": 0, "n_gen": 31, "n_depth": 128, "samples_ns": [100_000_000, 100_000_000, 50_000_000]}]
    got = sp.from_llama_bench(rows)
    assert got["prompt_tok_per_s"]["median"] == pytest.approx((12800 + 6400) / 2)
    assert got["ttft_ms"]["median"] == pytest.approx(15.0) and got["decode_tok_per_s"]["median"] == pytest.approx(310)
    assert (got["prompt_tokens"], got["gen_tokens"], got["depth"]) == (128, 32, 128)
    with pytest.raises(ValueError, match="one pp and one tg"):
        sp.from_llama_bench(rows[:1])


def test_batched_bench_rows_convert_to_generated_tokens_only() -> None:
    row = {"pp": 64, "tg": 31, "pl": 8, "t_pp": 0.5, "t_tg": 1.5, "speed": (8 * 64 + 8 * 31) / 2.0}
    got = sp.from_batched_bench([row])
    assert got["aggregate_tok_per_s"]["median"] == pytest.approx(8 * 32 / 2.0)  # not its `speed` (prompt included)
    assert got["decode_aggregate_tok_per_s"]["median"] == pytest.approx(8 * 31 / 1.5)
    assert (got["n_sequences"], got["gen_tokens"]) == (8, 32)


def test_prompts_differ() -> None:
    import numpy as np

    ps = sp.prompts(np.arange(1, 100)[None], 4, 64)
    assert len(ps) == 4 and all(len(p) == 64 for p in ps) and len({tuple(p) for p in ps}) == 4


def test_every_runner_with_speed_uses_the_shared_definitions() -> None:
    """No runner computes a speed itself: each records timestamps and builds its result with speed_result."""
    for engine in ("llamacpp", "vllm", "exllamav2"):
        src = (ROOT / "evaluators" / engine / "runner.py").read_text()
        assert "from evaluators.speed import" in src and "speed_result(" in src, engine
        assert "stats(" not in src, engine
        for key in ("ttft_ms", "prompt_tok_per_s", "decode_tok_per_s", "aggregate_tok_per_s"):
            assert f'"{key}"' not in src, (engine, key)
