"""The ExLlamaV2 server (evaluators/exllamav2/server.py + openai_server.py). Without CUDA it is refused with a
clear error and nothing is started; on a GPU (marked ``gpu``) a real server on an EXL2 file exllamav2
converted streams a completion with usage and stops cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.exl2.converter import EXL2Converter
from evaluators.serving.server import start_server
from evaluators.serving.spec import ServerSpec
from pipeline import exl2_env
from pipeline.config import Settings
from pipeline.errors import EngineError, ToolchainMissingError
from pipeline.specs import Engine, EXL2Backend, EXL2Spec
from tests.converters.test_exl2_gpu import _ctx
from tests.evaluators.serving.helpers import stream_completion, wait_gone
from tests.exl2_support import exl2_runtime, gpu_demo  # noqa: F401  (fixtures)


def test_without_cuda_the_server_is_refused_and_nothing_starts(tmp_path: Path, cache_dir: Path) -> None:
    settings = Settings(cache_dir=cache_dir, work_dir=tmp_path / "work", threads=2)
    if exl2_env.unavailable_reason(settings) is None:
        pytest.skip("ExLlamaV2 can run here: the gpu test below starts the real server")
    (tmp_path / "model").mkdir()
    spec = ServerSpec(engine=Engine.EXLLAMAV2, model=tmp_path / "model", slots=1, context=256)
    with pytest.raises(ToolchainMissingError) as err, start_server(spec, settings, tmp_path / "logs"):
        pass
    assert "unavailable here: ExLlamaV2 needs CUDA" in str(err.value)
    assert not list((tmp_path / "logs").glob("*.log")) and not list((tmp_path / "work").rglob("*.json"))


@pytest.mark.gpu
def test_exllamav2_server_streams_on_a_gpu(exl2_runtime: Settings, gpu_demo: Path,  # noqa: F811
                                           tmp_path: Path) -> None:
    cfg = exl2_runtime
    conv = EXL2Converter(cfg)
    spec_q = EXL2Spec(bpw=4.0, backend=EXL2Backend.EXLLAMAV2)
    ctx = _ctx(gpu_demo, cfg)
    built = conv.build(ctx, conv.prepare(ctx, [spec_q]), spec_q, tmp_path / "model")
    folder = next(iter(built.files.values())).parent
    spec = ServerSpec(engine=Engine.EXLLAMAV2, model=folder, slots=1, context=512, start_timeout_s=600)
    with start_server(spec, cfg, tmp_path / "logs") as srv:
        out = stream_completion(srv.base_url, srv.model_name, "The history of", max_tokens=16)
        mem = srv.memory_info()
        pids = [srv.keeper_pid, srv.pid]
        assert out["done"] and out["chunks"] >= 1 and out["usage"]["completion_tokens"] == 16
        assert mem.kv_cache_tokens and mem.kv_cache_tokens >= 512 and mem.kv_cache_bytes
        assert mem.device_after_load_bytes and mem.device_after_load_bytes > 0
        print(f"exllamav2 server: start {srv.start_s:.1f} s, device {mem.device_after_load_bytes / 2**20:.0f} MiB "
              f"({srv.device_method}), KV {mem.kv_cache_bytes / 2**20:.1f} MiB; {out}")
    assert wait_gone(pids, 10.0) == []
    many = spec.model_copy(update={"slots": 4})
    try:
        with start_server(many, cfg, tmp_path / "logs4") as srv:
            assert srv.info.flags["paged"] is True
    except EngineError as exc:  # no flash-attn in the environment: refused, not served one by one
        assert "paged attention" in exc.stderr_tail
