"""llama-server behind Quantyard's launcher (evaluators/llamacpp/server.py), a real process on the demo's Q4_K_M
GGUF: healthy before it is handed out, a streamed /v1/completions with usage, its slots and KV cache read from
its own log, memory measured, a clean stop that leaves no process or record, and a run killed with SIGKILL
that leaves no server behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from evaluators.serving.server import start_server
from evaluators.serving.spec import ServerSpec
from pipeline.config import Settings
from pipeline.errors import EngineError
from pipeline.specs import Engine
from registry import open_registry
from tests.evaluators.serving.helpers import kill_a_serving_run, stream_completion, wait_gone


@pytest.fixture(scope="module")
def gguf(demo_registry_template: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    reg = open_registry(str(demo_registry_template["registry"]))
    (path,) = reg.link_files("demo/Q4_K_M", tmp_path_factory.mktemp("served"))
    return path


def _settings(tmp_path: Path, cache_dir: Path) -> Settings:
    return Settings(cache_dir=cache_dir, work_dir=tmp_path / "work", threads=2)


def test_llama_server_serves_a_streamed_completion_and_stops(gguf: Path, tmp_path: Path, cache_dir: Path) -> None:
    settings = _settings(tmp_path, cache_dir)
    spec = ServerSpec(engine=Engine.LLAMA_CPP, model=gguf, slots=2, context=256, start_timeout_s=180)
    with start_server(spec, settings, tmp_path / "logs") as srv:
        info, flags = srv.info, srv.info.flags
        assert info.server == "llama-server" and "llama-cpp-python 0.3.36" in info.version
        assert info.parallel_slots == 2 and info.context_per_request == 256 and info.context_total == 512
        assert info.continuous_batching and info.tensor_parallel == 1 and info.command[0].endswith("llama-server")
        assert flags["n_slots"] == 2 and flags["n_ctx_slot"] == 256 and flags["kv_unified"] is False
        assert flags["cache_prompt"] is False and "--no-cache-prompt" in info.command and flags["threads"] == 2
        out = stream_completion(srv.base_url, srv.model_name, "def main():\n    ", max_tokens=8)
        assert out["done"] and out["chunks"] >= 1 and out["text"]
        assert out["usage"]["completion_tokens"] == 8 and out["usage"]["prompt_tokens"] > 0
        assert httpx.get(f"{srv.base_url}/metrics", timeout=10).status_code == 200
        mem = srv.memory_info()
        assert mem.weights_bytes == gguf.stat().st_size
        assert mem.rss_after_load_bytes and mem.rss_after_load_bytes > mem.weights_bytes
        assert mem.kv_cache_tokens == 512 and mem.kv_cache_bytes and mem.kv_cache_bytes > 0
        assert "llama_kv_cache: size" in (mem.kv_cache_source or "")
        records = list((settings.work_root / "servers").glob("*.json"))
        assert len(records) == 1
        pids = [srv.keeper_pid, srv.pid]
        print(f"llama-server start {srv.start_s:.2f} s; RSS after load {mem.rss_after_load_bytes / 2**20:.1f} MiB; "
              f"KV {mem.kv_cache_bytes / 2**20:.2f} MiB for {mem.kv_cache_tokens} tokens; peak "
              f"{(mem.rss_peak_bytes or 0) / 2**20:.1f} MiB; {out}")
    assert wait_gone(pids, 5.0) == []
    assert not records[0].exists()


def test_a_slot_smaller_than_asked_fails_the_start(gguf: Path, tmp_path: Path, cache_dir: Path) -> None:
    """The demo model was trained on 2,048 tokens: llama-server would cap a 4,096-token slot there."""
    spec = ServerSpec(engine=Engine.LLAMA_CPP, model=gguf, slots=1, context=4096, start_timeout_s=180)
    with pytest.raises(EngineError) as err, start_server(spec, _settings(tmp_path, cache_dir), tmp_path / "logs"):
        pass
    assert "fewer than the 4096 asked" in str(err.value) and "training context" in str(err.value)
    assert not list((tmp_path / "work" / "servers").glob("*.json"))


def test_a_killed_run_leaves_no_llama_server(gguf: Path, tmp_path: Path, cache_dir: Path) -> None:
    spec = ServerSpec(engine=Engine.LLAMA_CPP, model=gguf, slots=1, context=256, start_timeout_s=180)
    info = kill_a_serving_run(spec, {"cache_dir": str(cache_dir), "work_dir": str(tmp_path / "work"), "threads": 2},
                              tmp_path, timeout_s=240)
    assert info["left"] == [], info
    assert info["kill_to_gone_s"] < 5.0, info
